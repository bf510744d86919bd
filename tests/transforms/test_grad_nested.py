"""Higher-order gradients: fs.grad / fs.value_and_grad nest, against JAX's values.

The programs (``grad_nested_programs.py``) are written once; JAX runs them in a subprocess
(float64, 4 forced host devices; results cached in pytest's cache dir, keyed by the
programs' source and the jax version), fshard in this process (no ``shard_map``) and on 4
gloo ranks (all sharded programs in one rank task). Also pinned: the cost rule (a call that
nothing encloses keeps detached leaves and no ``create_graph``), ``create_graph=True`` for
torch's own ``backward``, and gradients under ``torch.no_grad``.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path

import grad_nested_programs as progs
import numpy as np
import pytest
import torch
from _harness.optional import skip_without
from torch.distributed.tensor import DTensor

import fshard as fs
from fshard.testing import run_on_ranks

pytestmark = pytest.mark.xdist_group("grad_nested")  # one JAX run and one rank task per session

HERE = Path(__file__).resolve().parent
MODES = {"checked": True, "unchecked": False}
RTOL, ATOL = 1e-9, 1e-12

# Second-order cases that need a change outside fshard/transforms (see each reason). strict:
# once the change lands the test passes, fails as XPASS, and the mark must go.


class FshardOps:
    """``o`` for fshard (see ``grad_nested_programs``): fs.lax, fs.grad, torch.func, and
    fs.shard_map on the mesh whose results are global tensors (``full_tensor``)."""

    P = staticmethod(fs.P)
    psum, pmean, pvary = staticmethod(fs.lax.psum), staticmethod(fs.lax.pmean), staticmethod(fs.lax.pvary)
    all_gather, psum_scatter = staticmethod(fs.lax.all_gather), staticmethod(fs.lax.psum_scatter)
    ppermute, all_to_all = staticmethod(fs.lax.ppermute), staticmethod(fs.lax.all_to_all)
    grad, value_and_grad, remat = staticmethod(fs.grad), staticmethod(fs.value_and_grad), staticmethod(fs.remat)
    jvp, vjp, vmap = staticmethod(torch.func.jvp), staticmethod(torch.func.vjp), staticmethod(torch.func.vmap)
    jacfwd, jacrev = staticmethod(torch.func.jacfwd), staticmethod(torch.func.jacrev)
    sin, tanh, stack = staticmethod(torch.sin), staticmethod(torch.tanh), staticmethod(torch.stack)

    def __init__(self, mesh=None, check: bool = True) -> None:
        self.mesh, self.check = mesh, check

    def shard_map(self, f, in_specs, out_specs):
        mapped = fs.shard_map(f, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check=self.check)
        return lambda *args: _global(mapped(*args))


def _global(y):
    return y.full_tensor() if isinstance(y, DTensor) else y


def _inputs() -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(v) for k, v in progs.inputs().items()}


def _attempt(thunk) -> np.ndarray | str:
    try:
        return thunk().detach().numpy()
    except Exception as e:  # noqa: BLE001 - recorded, and shown next to JAX's result
        return f"error: {type(e).__name__}: {e}"[:500]


def _run_sharded() -> dict[str, np.ndarray | str]:
    """Every sharded program in both modes, on this rank (results are global: rank 0's suffice)."""
    mesh = fs.make_mesh({"x": progs.WORLD})
    ins = _inputs()
    out = {}
    for mode, check in MODES.items():
        o = FshardOps(mesh, check)
        for loss in progs.LOSSES:
            for comp in progs.COMPOSITIONS:
                fn = progs.sharded(o, loss, comp, check)
                out[f"sharded/{loss}/{comp}/{mode}"] = _attempt(lambda fn=fn: fn(ins["w"], ins["x"], ins["v"]))
    return out


# --- the oracle ---------------------------------------------------------------------------
def _jax_key() -> str:
    h = hashlib.sha256((HERE / "grad_nested_programs.py").read_bytes())
    try:
        h.update(importlib.metadata.version("jax").encode())
    except importlib.metadata.PackageNotFoundError:
        pass
    return h.hexdigest()[:16]


@pytest.fixture(scope="module")
def jax_results(request, _jax_run) -> dict[str, np.ndarray | str]:
    """JAX's result of every program (from the cache when the programs did not change)."""
    cache, proc, out = _jax_run
    if proc is None:
        with open(cache, "rb") as f:
            return pickle.load(f)
    stdout, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, f"the JAX run failed:\n{stdout[-5000:]}"
    with open(out, "rb") as f:
        results = pickle.load(f)
    tmp_cache = cache.with_suffix(".tmp")
    with open(tmp_cache, "wb") as f:
        pickle.dump(results, f)
    os.replace(tmp_cache, cache)
    return results


@pytest.fixture(scope="module")
def _jax_run(request):
    """Starts the JAX run unless cached: ``(cache path, process or None, its output path)``."""
    skip_without("jax")  # the tests that compare with JAX; the others need none
    # No cache provider (tools/mutations.py runs pytest with -p no:cacheprovider): a throwaway dir.
    store = request.config.cache.mkdir("fshard-grad-nested") if hasattr(request.config, "cache") else \
        Path(tempfile.mkdtemp(prefix="fshard-grad-nested-"))
    cache = store / f"jax-{_jax_key()}.pkl"
    if cache.exists():
        yield cache, None, None
        return
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "jax.pkl")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_"))}
        env.update(OMP_NUM_THREADS="1")
        proc = subprocess.Popen([sys.executable, str(HERE / "grad_nested_programs.py"), out], env=env,
                                cwd=str(HERE), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            yield cache, proc, out
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


@pytest.fixture(scope="module")
def fshard_sharded(_jax_run) -> dict[str, np.ndarray | str]:
    """fshard's results of the sharded programs, computed while JAX runs."""
    return run_on_ranks(_run_sharded, world_size=progs.WORLD)[0]


def _assert_matches(got, want, name: str) -> None:
    assert not isinstance(want, str), f"{name}: JAX refused: {want}"
    assert not isinstance(got, str), f"{name}: fshard raised where JAX gives {want}: {got}"
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL, err_msg=name)


# --- shard_map, both modes, every composition -------------------------------------------------
def _sharded_params():
    for loss in progs.LOSSES:
        for comp in progs.COMPOSITIONS:
            for mode in MODES:
                yield pytest.param(f"sharded/{loss}/{comp}/{mode}", id=f"{loss}-{comp}-{mode}")


@pytest.mark.parametrize("name", list(_sharded_params()))
def test_sharded_hvp_matches_jax(name, fshard_sharded, jax_results):
    _assert_matches(fshard_sharded[name], jax_results[name.rsplit("/", 1)[0]], name)


# --- no shard_map ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(progs.LOCAL))
def test_local_program_matches_jax(name, jax_results):
    ins = _inputs()
    got = _attempt(lambda: progs.LOCAL[name](FshardOps(), ins["a"], ins["b"]))
    _assert_matches(got, jax_results[f"local/{name}"], name)


def _dtensor_grad_grad_shard_map() -> float:
    """grad(grad(shard_map)) of the pvary loss with fs.shard'ed (DTensor) arguments."""
    mesh = fs.make_mesh({"x": progs.WORLD})
    ins = _inputs()
    w, x, v = fs.shard(ins["w"], fs.P(), mesh), fs.shard(ins["x"], fs.P("x"), mesh), fs.shard(ins["v"], fs.P(), mesh)
    o = FshardOps(mesh, True)
    sm = fs.shard_map(lambda w, x: progs.LOSSES["pvary"](o, w, x, True), mesh=mesh, in_specs=(fs.P(), fs.P("x")),
                      out_specs=fs.P())
    return fs.gather(fs.grad(lambda u: (fs.grad(sm)(u, x) * v).sum())(w)).numpy()


def test_grad_grad_shard_map_of_dtensor_arguments_matches_jax(jax_results):
    got = run_on_ranks(_dtensor_grad_grad_shard_map, world_size=progs.WORLD)[0]
    _assert_matches(got, jax_results["sharded/pvary/grad_grad_sm"], "dtensor grad_grad_sm")


def _issue_program_in_body(check: bool) -> float:
    """The issue's grad(grad(cube)) on x split over "x": 6x on every block, both orders."""
    mesh = fs.make_mesh({"x": progs.WORLD})
    x = _inputs()["x"]
    gg = fs.grad(lambda y: fs.grad(lambda z: (z ** 3).sum())(y).sum())
    inside = fs.shard_map(gg, mesh=mesh, in_specs=fs.P("x"), out_specs=fs.P("x"), check=check)(x)
    cube = fs.shard_map(lambda z: fs.lax.psum((z ** 3).sum(), "x"), mesh=mesh, in_specs=fs.P("x"), out_specs=fs.P(),
                        check=check)
    outside = fs.grad(lambda y: _global(fs.grad(cube)(y)).sum())(x)
    return max((_global(inside) - 6 * x).abs().max().item(), (outside - 6 * x).abs().max().item())


def _step_keeps_no_graph(check: bool) -> bool:
    """A training step, shard_map(value_and_grad), with fs.shard'ed parameters that require
    grad (the body sees them as non-leaves): nothing encloses the call, so no graph is kept."""
    mesh = fs.make_mesh({"x": progs.WORLD})
    ins = _inputs()
    w = fs.shard(ins["w"].clone().requires_grad_(), fs.P(), mesh)
    step = fs.shard_map(fs.value_and_grad(lambda w, x: progs.LOSSES["pvary"](FshardOps(mesh, check), w, x, check)),
                        mesh=mesh, in_specs=(fs.P(), fs.P("x")), out_specs=(fs.P(), fs.P()), check=check)
    value, g = step(w, ins["x"])
    return w.requires_grad and not value.requires_grad and not g.requires_grad


@pytest.mark.parametrize("mode", list(MODES))
def test_grad_of_grad_in_and_around_shard_map(mode):
    assert max(run_on_ranks(_issue_program_in_body, MODES[mode], world_size=progs.WORLD)) < 1e-12
    assert all(run_on_ranks(_step_keeps_no_graph, MODES[mode], world_size=progs.WORLD))


# --- the cost rule, torch's backward, grad mode ----------------------------------------------
def _loss(p, x):
    return (torch.tanh(x @ p["w"]) ** 2).sum() + (p["b"] ** 3).sum()


def _params(requires_grad: bool):
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(3, 2, generator=g, dtype=torch.float64).requires_grad_(requires_grad),
            "b": torch.randn(2, generator=g, dtype=torch.float64).requires_grad_(requires_grad)}


@pytest.mark.parametrize("requires_grad", [False, True])
def test_unenclosed_call_keeps_no_graph_even_for_parameters_that_require_grad(requires_grad):
    # A training step (fs.nn.functionalize's and fs.shard's parameters require grad): detached
    # leaves and no create_graph, so the results hold no graph (no time, no memory).
    p, x = _params(requires_grad), torch.ones(4, 3, dtype=torch.float64)
    value, grads = fs.value_and_grad(_loss)(p, x)
    assert not value.requires_grad and not any(g.requires_grad for g in grads.values())
    ref = torch.func.grad(_loss)({k: v.detach() for k, v in p.items()}, x)
    assert all(torch.allclose(grads[k], ref[k]) for k in p)


def test_functionalized_module_parameters_take_the_same_path():
    apply, params, _ = fs.nn.functionalize(torch.nn.Linear(3, 2).double())
    assert all(p.requires_grad for p in fs.tree.leaves(params))  # why the rule cannot use requires_grad
    grads = fs.grad(lambda p: apply(p, torch.ones(4, 3, dtype=torch.float64)).pow(2).sum())(params)
    assert not any(g.requires_grad for g in fs.tree.leaves(grads))


def test_create_graph_lets_torch_backward_differentiate_a_gradient_penalty():
    # WGAN-GP: the penalty's gradient w.r.t. the critic's parameters (closed over) needs the graph.
    torch.manual_seed(0)
    critic = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1)).double()
    x_hat = torch.randn(4, 3, dtype=torch.float64)

    def penalty(grad_fn):
        g = grad_fn(lambda x: critic(x).sum())(x_hat)
        return ((g.norm(dim=1) - 1) ** 2).mean()

    def torch_grad(f):
        def g(x):
            x = x.detach().requires_grad_()
            return torch.autograd.grad(f(x), x, create_graph=True)[0]
        return g

    penalty(lambda f: fs.grad(f, create_graph=True)).backward()
    got = [p.grad for p in critic.parameters()]
    critic.zero_grad(set_to_none=True)
    penalty(torch_grad).backward()
    want = [p.grad for p in critic.parameters()]
    assert sum(g is not None for g in want) == 3  # the last bias does not move the gradient
    assert all((a is None and b is None) or torch.allclose(a, b, rtol=1e-12) for a, b in zip(got, want))
    # Without create_graph (nothing encloses the call), the gradient is a constant, as
    # torch.autograd.grad's is without create_graph.
    assert not fs.grad(lambda x: critic(x).sum())(x_hat).requires_grad


def test_gradients_under_no_grad_are_computed():
    p, x = _params(False), torch.ones(4, 3, dtype=torch.float64)
    with torch.no_grad():
        grads = fs.grad(_loss)(p, x)
        hvp = fs.grad(lambda q: (fs.grad(_loss)(q, x)["b"]).sum())(p)  # constants, but right
    ref = torch.func.grad(_loss)(p, x)
    assert all(torch.allclose(grads[k], ref[k]) for k in p)
    assert torch.allclose(hvp["b"], 6 * p["b"]) and not hvp["b"].requires_grad


def test_grad_depth_is_restored_after_an_error():
    from fshard.transforms.grad import depth

    with pytest.raises(ZeroDivisionError):
        fs.grad(lambda y: fs.grad(lambda z: (z / 0.0).sum() + 1 // 0)(y).sum())(torch.ones(2))
    assert depth() == (0, False)
