"""``fs.parallel.ScanConfig``: the layer loop's options as one frozen object.

``scan_layers(config=ScanConfig(...))`` and the old keywords (deprecated for one release)
give bitwise identical losses and gradients on real ranks; the old keywords warn, naming
each keyword and the config call that replaces it; a config together with an old keyword
is a TypeError naming both; a bad option is refused when the config is built, in the
house template; and the repo's own callers (the bench-like step in ``fshard.testing``)
emit no DeprecationWarning.
"""

import warnings

import attrs
import pytest
import torch

import fshard as fs
from fshard import P
from fshard.testing import run_on_ranks, transformer_train_step

ScanConfig = fs.parallel.ScanConfig
# Mixed precision changes the values, so a form that dropped an option would not match.
OPTIONS = dict(prefetch=2, reshard_after_forward=False, remat=True, remat_policy="nothing_saveable",
               policy=fs.Policy(param_dtype=torch.float32))


def _params(n_layers=3, dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"w1": torch.randn(dim, dim, generator=g, dtype=torch.float64) * 0.3,
             "w2": torch.randn(dim, dim, generator=g, dtype=torch.float64) * 0.3} for _ in range(n_layers)]


def _block(lp, h):
    # In the gathered parameters' dtype (float32 under OPTIONS' policy), the residual in float64.
    return h + torch.tanh(h.to(lp["w1"].dtype) @ lp["w1"]) @ lp["w2"]


def _step(form, options):
    """One FSDP step over every rank's "d" axis; ``form``: "config" or "keywords"."""
    mesh = fs.make_mesh({"d": torch.distributed.get_world_size()})
    params = _params()
    specs = fs.parallel.fsdp_specs(params, "d")
    sharded = fs.shard(params, specs, mesh, uneven=True)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4 * mesh.axis_size("d"), 8, generator=g, dtype=torch.float64)
    y = torch.randn(4 * mesh.axis_size("d"), 8, generator=g, dtype=torch.float64)
    config = ScanConfig(**options)

    def body(p, a, b):
        if form == "config":
            h = fs.parallel.scan_layers(_block, p, a, axis="d", config=config)
        else:
            h = fs.parallel.scan_layers(_block, p, a, axis="d", **options)
        return fs.lax.pmean(((h - b) ** 2).mean(), "d")

    step = fs.value_and_grad(fs.shard_map(body, mesh=mesh, in_specs=(specs, P("d"), P("d")), out_specs=P()))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss, grads = step(sharded, x, y)
    deprecations = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
    local = [t.to_local().clone() for t in fs.tree.leaves(grads)]
    return loss.item(), local, deprecations


def _both_forms(options):
    return _step("config", options), _step("keywords", options)


@pytest.mark.parametrize("options", [OPTIONS, dict(reshard_after_forward=True, prefetch=0)])
def test_config_and_deprecated_keywords_give_bitwise_identical_results(options):
    plain = run_on_ranks(_step, "config", {}, world_size=2)
    for ((loss_c, grads_c, warned_c), (loss_k, grads_k, warned_k)), (loss_0, _, _) in zip(
            run_on_ranks(_both_forms, options, world_size=2), plain):
        assert loss_c == loss_k
        assert (loss_c != loss_0) == ("policy" in options)  # the options reached the loop
        assert len(grads_c) == len(grads_k) and all(torch.equal(a, b) for a, b in zip(grads_c, grads_k))
        assert warned_c == []
        assert warned_k and all("config=ScanConfig(" in w for w in warned_k)


def _one_rank(**kwargs):
    mesh = fs.make_mesh({"d": 1})
    params = _params(n_layers=2)
    specs = fs.parallel.fsdp_specs(params, "d")
    f = fs.shard_map(lambda p, a: fs.parallel.scan_layers(_block, p, a, axis="d", **kwargs), mesh=mesh,
                     in_specs=(specs, P()), out_specs=P())
    return f(fs.shard(params, specs, mesh), torch.ones(2, 8, dtype=torch.float64))


def test_deprecated_keyword_warns_naming_it_and_the_config_at_the_caller():
    with pytest.warns(DeprecationWarning) as record:
        _one_rank(prefetch=2, remat=True)
    (w,) = [w for w in record if issubclass(w.category, DeprecationWarning)]
    msg = str(w.message)
    assert "scan_layers" in msg and "prefetch" in msg and "remat" in msg
    assert "config=ScanConfig(prefetch=..., remat=...)" in msg
    assert "next release" in msg


def test_config_and_old_keyword_together_is_a_type_error_naming_both():
    with pytest.raises(TypeError) as e:
        _one_rank(config=ScanConfig(prefetch=2), remat=True)
    assert "config=" in str(e.value) and "remat=" in str(e.value) and "attrs.evolve(config, remat=...)" in str(e.value)


def test_unknown_keyword_is_a_type_error_listing_the_options():
    with pytest.raises(TypeError, match="unexpected keyword argument 'prefech'") as e:
        _one_rank(prefech=2)
    assert "prefetch" in str(e.value) and "ScanConfig" in str(e.value)


def test_the_config_path_warns_nothing():
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        _one_rank(config=ScanConfig(**OPTIONS))
        _one_rank()


@pytest.mark.parametrize("bad, kind, needles", [
    (dict(prefetch=-1), ValueError, ["ScanConfig.prefetch=-1", "int >= 0"]),
    (dict(prefetch=True), ValueError, ["ScanConfig.prefetch=True"]),
    (dict(bucket_bytes=-5), ValueError, ["ScanConfig.bucket_bytes=-5", "int >= 0"]),
    (dict(reshard_after_forward=2.0), TypeError, ["reshard_after_forward=2.0", "float", "an int"]),
    (dict(reshard_after_forward=()), TypeError, ["reshard_after_forward=()"]),
    (dict(remat=1), TypeError, ["ScanConfig.remat=1", "True or False"]),
    (dict(offload="yes"), TypeError, ["ScanConfig.offload='yes'"]),
    (dict(remat_policy="save_everything"), ValueError, ["ScanConfig.remat_policy='save_everything'",
                                                        "save_collectives"]),
    (dict(remat_policy=3), TypeError, ["ScanConfig.remat_policy=3", "op -> bool"]),
    (dict(policy=torch.float32), TypeError, ["ScanConfig.policy=torch.float32", "fs.Policy"]),
    (dict(dim=1.0), TypeError, ["ScanConfig.dim=1.0", "None to infer"]),
])
def test_bad_options_are_refused_when_the_config_is_built(bad, kind, needles):
    with pytest.raises(kind) as e:
        ScanConfig(**bad)
    for needle in needles:
        assert needle in str(e.value), (needle, str(e.value))


def test_config_is_frozen_hashable_and_keeps_lists_as_tuples():
    c = ScanConfig(reshard_after_forward=["fsdp_in"], forward_prefetch=[[1, 2], [2], []])
    assert c.reshard_after_forward == ("fsdp_in",)
    assert c.forward_prefetch == ((1, 2), (2,), ())
    assert hash(c) == hash(ScanConfig(reshard_after_forward=("fsdp_in",), forward_prefetch=((1, 2), (2,), ())))
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        c.prefetch = 3
    assert ScanConfig() == ScanConfig(prefetch=1, reshard_after_forward=True, bucket_bytes=25 * 2**20)


def _repo_step_warns_nothing():
    # fshard.testing's transformer step is what bench/ and the jit tests run: DDP with a
    # bucket (config path), gather_params and scan_layers inside value_and_grad.
    from fshard.models import TransformerConfig

    mesh = fs.make_mesh({"d": torch.distributed.get_world_size()})
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        cfg = TransformerConfig(vocab_size=16, dim=8, n_layers=2, n_heads=2, max_seq_len=4)
        for mode, bucket in (("replicate", 1), ("fsdp", None)):
            step, params, state = transformer_train_step(mode, cfg, mesh, axis="d", bucket_bytes=bucket)
            tok = torch.randint(0, 16, (2 * mesh.axis_size("d"), 4), generator=torch.Generator().manual_seed(0))
            step(params, state, tok, tok)
    return True


def test_in_repo_layer_loop_callers_emit_no_deprecation_warning():
    assert all(run_on_ranks(_repo_step_warns_nothing, world_size=2))
