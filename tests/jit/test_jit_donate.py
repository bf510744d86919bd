"""fs.jit(donate_argnums=...): results computed into the donated arguments' tensors (JAX's
buffer donation), equal to the undonated call, on one process and on FSDP-sharded ranks."""

import warnings

import pytest
import torch
from torch.distributed.tensor import DTensor

import fshard as fs
from fshard import P
from fshard.testing import run_on_ranks

F64 = torch.float64
TIMEOUT = pytest.mark.timeout(240)


def _sgd_step(p, m, x):
    """A pure step of the usual form: new params and state of the old ones' layouts."""
    g = {k: 2 * v * x.mean() for k, v in p.items()}
    m = {k: 0.9 * m[k] + g[k] for k in m}
    return (p["w"] * x).sum(), {k: p[k] - 0.1 * m[k] for k in p}, m


def _tree(seed):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(4, 3, generator=g, dtype=F64), "b": torch.randn(3, generator=g, dtype=F64)}


@TIMEOUT
@pytest.mark.parametrize("backend", [None, "aot_eager", "inductor"])
def test_donated_results_equal_undonated_and_are_the_arguments(backend):
    p0, m0, x = _tree(0), _tree(1), torch.randn(4, 3, dtype=F64)
    x0 = x.clone()
    plain = fs.jit(_sgd_step, backend=backend)
    donated = fs.jit(_sgd_step, backend=backend, donate_argnums=(0, 1))
    ref_p, ref_m = p0, m0
    p, m = {k: v.clone() for k, v in p0.items()}, {k: v.clone() for k, v in m0.items()}
    for step in range(3):  # the second and third calls run the cached graph on the results
        ref_loss, ref_p, ref_m = plain(ref_p, ref_m, x)
        old = {**{"p" + k: v for k, v in p.items()}, **{"m" + k: v for k, v in m.items()}}
        ptrs = {k: v.data_ptr() for k, v in old.items()}
        loss, p, m = donated(p, m, x)
        for k, v in old.items():  # consumed, as JAX deletes a donated array
            with pytest.raises(fs.DonatedTensorError, match=r"args\[[01]\]"):
                v + 1
        assert torch.equal(loss, ref_loss), step
        for k in ref_p:
            torch.testing.assert_close(p[k], ref_p[k], rtol=0, atol=1e-12)
            torch.testing.assert_close(m[k], ref_m[k], rtol=0, atol=1e-12)
            # The result is the donated argument's own tensor (no new buffer).
            assert p[k].data_ptr() == ptrs["p" + k] and m[k].data_ptr() == ptrs["m" + k], (step, k)
    assert donated.cache_size == 1
    # The undonated argument is untouched; the undonated jit left its arguments as they were.
    assert torch.equal(x, x0) and all(torch.equal(p0[k], _tree(0)[k]) for k in p0)


@TIMEOUT
def test_donation_with_no_matching_result_warns_with_the_path_and_changes_nothing():
    def f(a, b):
        return a * 2

    a, b = torch.ones(3, dtype=F64), {"k": torch.zeros(2, dtype=F64)}
    with pytest.warns(UserWarning, match=r"args\[1\]\.k"):
        out = fs.jit(f, backend=None, donate_argnums=1)(a, b)
    assert torch.equal(b["k"], torch.zeros(2, dtype=F64)) and torch.equal(out, 2 * a)


@TIMEOUT
def test_an_argument_returned_as_it_is_is_not_copied_into_another():
    # out = (x, new): x is returned unchanged. It must not be "computed into" y's buffer
    # (y is donated and of x's layout), and the fresh result goes to y, not to x.
    def f(x, y):
        return x, y + x

    x, y = torch.full((3,), 2.0, dtype=F64), torch.ones(3, dtype=F64)
    yptr = y.data_ptr()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        a, b = fs.jit(f, backend=None, donate_argnums=(0, 1))(x, y)
    assert torch.equal(a, torch.full((3,), 2.0, dtype=F64)) and torch.equal(b, torch.full((3,), 3.0, dtype=F64))
    assert b.data_ptr() == yptr and a is x  # x, returned as it is, is not consumed


def test_a_donated_tensor_passed_twice_is_refused_naming_both():
    # JAX's rule: the graph would overwrite memory it still reads through the other argument.
    p, x = _tree(0), torch.randn(4, 3, dtype=F64)
    with pytest.raises(ValueError, match=r"args\[0\]\.w and args\[1\]\.w"):
        fs.jit(_sgd_step, backend=None, donate_argnums=0)(p, {"w": p["w"], "b": p["b"].clone()}, x)


@TIMEOUT
def test_a_tensor_passed_twice_then_two_tensors_are_two_signatures():
    # Tracing makes one input of a tensor passed twice; a later call with two different
    # tensors must not run that graph (it would read one of them for both).
    f = fs.jit(lambda a, b: a * 2 + b, backend=None)
    a, b = torch.ones(3, dtype=F64), torch.full((3,), 5.0, dtype=F64)
    assert torch.equal(f(a, a), torch.full((3,), 3.0, dtype=F64))
    assert torch.equal(f(a, b), torch.full((3,), 7.0, dtype=F64)) and f.cache_size == 2


def test_bad_donate_argnums_are_refused_naming_them():
    with pytest.raises(ValueError, match="donate_argnums=-1"):
        fs.jit(_sgd_step, donate_argnums=-1)
    with pytest.raises(ValueError, match=r"donate_argnums=\(3,\).*3 positional"):
        fs.jit(_sgd_step, backend=None, donate_argnums=3)(_tree(0), _tree(1), torch.ones(4, 3, dtype=F64))


def _donated(f, *args, **kwargs):
    """Which top-level arguments ``f`` (a jitted step) computed its results into: their names."""
    ptrs = {k: v.data_ptr() for k, v in {**dict(zip("abc", args)), **kwargs}.items()}
    out = f(*args, **kwargs)
    return sorted(k for k, v in ptrs.items() if any(o.data_ptr() == v for o in out))


def test_donate_argnames_donate_by_keyword_and_by_position_as_jax_does():
    # jax.jit's rule (tests/conformance/test_donation_jax.py checks it against JAX): given
    # only names (or only positions), the other is inferred from the signature, so an
    # argument is donated however it is passed; given both, each applies as given.
    def f(a, b, c):
        return a + 1, b + 1, c + 1

    def t():
        return torch.zeros(2, dtype=F64)

    by_name = fs.jit(f, backend=None, donate_argnames=("a", "c"))
    assert _donated(by_name, t(), t(), t()) == ["a", "c"]
    assert _donated(by_name, t(), b=t(), c=t()) == ["a", "c"]
    assert _donated(fs.jit(f, backend=None, donate_argnums=2), t(), t(), c=t()) == ["c"]
    both = fs.jit(f, backend=None, donate_argnums=0, donate_argnames="c")
    assert _donated(both, t(), t(), t()) == ["a"]  # c passed by position: not named by position
    assert _donated(both, a=t(), b=t(), c=t()) == ["c"]  # a passed by keyword: not named by keyword

    @fs.jit(backend=None, donate_argnames="b")  # the decorator form
    def g(a, b, c):
        return f(a, b, c)

    out = g(t(), b=torch.ones(2, dtype=F64), c=t())
    assert torch.equal(out[1], torch.full((2,), 2.0, dtype=F64))
    assert _donated(g, t(), t(), c=t()) == ["b"]


def test_bad_donate_argnames_are_refused_naming_them():
    def f(a, /, b, *, c):
        return b

    with pytest.raises(ValueError, match=r"no argument named d"):
        fs.jit(f, donate_argnames=("b", "d"))
    with pytest.raises(ValueError, match=r"\['a'\] cannot be passed by keyword"):
        fs.jit(f, donate_argnames="a")
    with pytest.raises(ValueError, match="donate_argnames=3"):
        fs.jit(f, donate_argnames=3)
    fs.jit(lambda a, **kw: a, donate_argnames="anything")  # **kwargs takes any name
    with pytest.raises(ValueError, match="signature cannot be inspected"):  # a builtin
        fs.jit(torch.add, donate_argnames="input")
    fs.jit(torch.add, donate_argnums=0)  # positions need no signature


@TIMEOUT
def test_results_that_alias_arguments_without_a_view_are_returned_as_they_are():
    # detach() and set_() alias an argument's memory without making a view (no ``_base``):
    # swapping two donated arguments through them must not copy one into the other.
    def swap(x, y):
        return y.detach(), torch.empty(0, dtype=F64).set_(x)

    x, y = torch.full((3,), 2.0, dtype=F64), torch.ones(3, dtype=F64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        a, b = fs.jit(swap, backend=None, donate_argnums=(0, 1))(x, y)
    assert torch.equal(a, torch.ones(3, dtype=F64)) and torch.equal(b, torch.full((3,), 2.0, dtype=F64))


def test_a_donated_tensor_sharing_memory_with_another_argument_is_refused():
    # No view relation between the two tensors (set_, as_strided on the storage, two tensors
    # over one numpy array): the memory overlaps all the same.
    f = fs.jit(lambda a, b: (a * 2, b + 1), backend=None, donate_argnums=0)
    a = torch.zeros(6, dtype=F64)
    flat = torch.zeros(12, dtype=F64)
    arr = flat.numpy()
    for other in (torch.empty(0, dtype=F64).set_(a.untyped_storage(), 0, (6,)),
                  torch.empty(0, dtype=F64).set_(a.untyped_storage()).as_strided((3,), (2,), 1)):
        with pytest.raises(ValueError, match=r"memory is also passed as another argument: args\[0\] and args\[1\]"):
            f(a, other)
    with pytest.raises(ValueError, match=r"args\[0\] and args\[1\]"):
        f(torch.from_numpy(arr[:6]), torch.from_numpy(arr[4:10]))

    # Meta tensors hold no memory (every data_ptr is 0): two of them do not overlap.
    meta = fs.jit(lambda a, b: (a * 2, b + 1), backend="aot_eager", donate_argnums=0)
    out = meta(torch.ones(6, dtype=F64, device="meta"), torch.ones(6, dtype=F64, device="meta"))
    assert [o.device.type for o in out] == ["meta", "meta"]


@TIMEOUT
@pytest.mark.parametrize("backend", [None, "aot_eager"])
def test_disjoint_parts_of_one_buffer_may_both_be_donated(backend):
    # Parameters living in one flat buffer: each result is computed into its own part, and
    # b's result reads a (donated, overwritten) before it is overwritten, on the second
    # call too (the cached graph).
    def step(a, b):
        return a * 2, b + a.sum()

    flat = torch.arange(12, dtype=F64)
    a, b = flat[:6], flat[6:]
    f = fs.jit(step, backend=backend, donate_argnums=(0, 1))
    for _ in range(2):
        want = step(a.clone(), b.clone())
        out = f(a, b)
        assert (out[0].data_ptr(), out[1].data_ptr()) == (flat.data_ptr(), flat[6:].data_ptr())
        assert torch.equal(flat, torch.cat(want))
        a, b = out


def _fsdp_donated_steps(backend, order="outside"):
    """An FSDP MLP step with AdamW, donated vs not vs eager, 3 steps: losses, params and state
    equal, each donated result a DTensor on the argument's local shard (its storage reused).
    ``order``: ``value_and_grad(shard_map(body))`` ("outside") or
    ``shard_map(value_and_grad(body))`` ("inside", the gradients leave the body sharded)."""
    n = torch.distributed.get_world_size()
    mesh = fs.make_mesh({"x": n})
    g = torch.Generator().manual_seed(0)
    p0 = {"w1": torch.randn(4, 8, generator=g, dtype=F64) / 2, "w2": torch.randn(8, 2, generator=g, dtype=F64)}
    specs = {k: P("x") for k in p0}
    opt = fs.optim.adamw(1e-2, weight_decay=0.1)

    def body(p, x, y):
        full = {k: fs.lax.all_gather(v, "x", tiled=True) for k, v in p.items()}
        return fs.lax.pmean(((torch.tanh(x @ full["w1"]) @ full["w2"] - y) ** 2).mean(), "x")

    if order == "outside":
        grad = fs.value_and_grad(fs.shard_map(body, mesh=mesh, in_specs=(specs, P("x"), P("x")), out_specs=P()))
    else:
        grad = fs.shard_map(fs.value_and_grad(body), mesh=mesh, in_specs=(specs, P("x"), P("x")),
                            out_specs=(P(), specs))

    def step(p, s, x, y):
        loss, gr = grad(p, x, y)
        upd, s = opt.update(gr, s, p)
        return loss, fs.optim.apply_updates(p, upd), s

    plain, donated = fs.jit(step, backend=backend), fs.jit(step, backend=backend, donate_argnums=(0, 1))
    pa = fs.shard(p0, specs, mesh)
    pb = fs.shard(p0, specs, mesh)
    pe = fs.shard(p0, specs, mesh)  # the eager step's: the reference of both jitted ones
    sa, sb, se = opt.init(pa), opt.init(pb), opt.init(pe)
    for i in range(3):
        gd = torch.Generator().manual_seed(10 + i)
        x, y = torch.randn(4 * n, 4, generator=gd, dtype=F64), torch.randn(4 * n, 2, generator=gd, dtype=F64)
        la, pa, sa = plain(pa, sa, x, y)
        le, pe, se = step(pe, se, x, y)
        before = {k: v.to_local().data_ptr() for k, v in pb.items()}
        state_ptrs = [t.to_local().data_ptr() for t in fs.tree.leaves(sb) if isinstance(t, DTensor)]
        old = pb
        lb, pb, sb = donated(pb, sb, x, y)
        for k, v in old.items():  # consumed, as JAX deletes a donated array
            with pytest.raises(fs.DonatedTensorError, match=r"args\[0\]\." + k):
                v.full_tensor()
            with pytest.raises(fs.DonatedTensorError):
                v * 2
        assert torch.equal(la.full_tensor(), lb.full_tensor()), i
        torch.testing.assert_close(la.full_tensor(), le.full_tensor(), rtol=0, atol=1e-12)
        # The moments too are computed into the donated state's shards.
        assert [t.to_local().data_ptr() for t in fs.tree.leaves(sb) if isinstance(t, DTensor)] == state_ptrs
        for k in pa:
            assert pb[k].to_local().data_ptr() == before[k], (i, k)
            assert pb[k].placements == pa[k].placements
            torch.testing.assert_close(pb[k].to_local(), pa[k].to_local(), rtol=0, atol=1e-12)
            torch.testing.assert_close(pa[k].to_local(), pe[k].to_local(), rtol=0, atol=1e-12)
        for a, b, e in zip(fs.tree.leaves(sa), fs.tree.leaves(sb), fs.tree.leaves(se)):
            a, b, e = (t.to_local() if hasattr(t, "to_local") else t for t in (a, b, e))
            torch.testing.assert_close(b, a, rtol=0, atol=1e-12)
            torch.testing.assert_close(a, e, rtol=0, atol=1e-12)
        # b is a view of sb's last shard: alive at the next donated call, it would keep that
        # shard from donation (fs.jit: a donated buffer with a live alias is not donated).
        del a, b, e
    return True


@TIMEOUT
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_fsdp_step_donated_equals_undonated_on_two_ranks(backend):
    # Inductor: the AdamW kernels write into the donated shards while the step's collectives
    # (all-gathers of those shards, the gradients' reduce-scatters) are in the same graph.
    assert all(run_on_ranks(_fsdp_donated_steps, backend, world_size=2))


@TIMEOUT
def test_fsdp_step_donated_equals_undonated_with_value_and_grad_inside_shard_map():
    assert all(run_on_ranks(_fsdp_donated_steps, "aot_eager", "inside", world_size=2))


def test_a_donated_tensor_holds_no_memory_after_the_call_so_torch_internals_cannot_write_into_the_result():
    # autograd accumulates into a .grad in C++, past __torch_function__: a donated .grad that
    # kept the result's memory would have the next backward's gradient added to the result.
    w = torch.ones(3, dtype=F64, requires_grad=True)
    (w * 2).sum().backward()
    r = fs.jit(lambda g: g * 10, backend=None, donate_argnums=0)(w.grad)
    assert torch.equal(r, torch.full((3,), 20.0, dtype=F64))
    with pytest.raises(RuntimeError):  # the donated .grad has no memory left: C++ refuses it
        (w * 2).sum().backward()
    assert torch.equal(r, torch.full((3,), 20.0, dtype=F64))


def test_a_donated_tensor_used_in_a_list_op_names_its_path_shape_and_dtype():
    p = {"w": torch.zeros(2, 3, dtype=F64), "b": torch.zeros(3, dtype=F64)}
    new = fs.jit(lambda p: {k: v + 1 for k, v in p.items()}, backend=None, donate_argnums=0)(p)
    for use in (lambda: torch.cat([new["b"], p["b"]]), lambda: torch._foreach_add(list(p.values()), 1.0)):
        with pytest.raises(fs.DonatedTensorError, match=r"donated \(args\[0\]\.[wb], shape \((2, 3|3,)\), torch.float64\)"):
            use()


class _Tagged(torch.Tensor):
    __slots__ = ("tag",)


def test_a_donated_tensor_subclass_is_not_donated_and_says_so_before_anything_is_written():
    # Its class cannot be switched to an unusable one after the call: it is left out of the
    # donation at trace time, with a warning naming it, and left unchanged.
    a = torch.zeros(3, dtype=F64).as_subclass(_Tagged)
    b = torch.zeros(3, dtype=F64)
    with pytest.warns(UserWarning, match=r"tensor subclass are not donated.*args\[0\] \(_Tagged\)"):
        ra, rb = fs.jit(lambda a, b: (a + 1, b + 2), backend=None, donate_argnums=(0, 1))(a, b)
    assert torch.equal(a.as_subclass(torch.Tensor), torch.zeros(3, dtype=F64)) and float(ra.sum()) == 3.0
    with pytest.raises(fs.DonatedTensorError):
        b + 0
    assert torch.equal(rb, torch.full((3,), 2.0, dtype=F64))
