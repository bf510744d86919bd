"""GPU check: several ranks on one GPU through gloo with CUDA tensors, each step equal to one process.

NCCL refuses two ranks on one device, so this is the only way one GPU exercises the
multi-rank device paths: 2 forked ranks (``fs.run_local``), a gloo group, meshes made
with ``device_type="cuda"`` (both ranks on cuda:0). gloo moves CUDA tensors through
pinned host buffers in its collectives; its point-to-point cannot (fshard stages those
through the host: ``fshard.comm.via_host``). Parts, each against a one-process
reference computed on the CPU in float64 on the same rank:

- collectives: psum, all_gather, psum_scatter, all_to_all, ppermute over 2 ranks;
- init_sharded: bit for bit, and each rank's CUDA memory rose by at most its half of
  the model plus one full parameter (below the whole model, so holding it would fail);
- fsdp: 2 Adam steps of an MLP stack through ``gather_params`` + ``scan_layers``;
- tp: a Megatron Transformer (``tp_specs``, ``tp_transformer_block``, loss parallel);
- pipeline: one 1F1B ``pipeline_step`` over 2 stages, 4 microbatches.

First, a probe without assertions: each of torch's own gloo collectives on CUDA tensors,
unstaged, in its own pair of ranks, recorded as ok or how it failed (the H100 run of
2026-11-26, torch 2.11.0+cu130, died of SIGSEGV in the functional all-gather).

Device assertions: every shard, gradient and result was on CUDA. The parent process
never touches CUDA (it forks the ranks).

    python bench/gpu_checks/check_gloo_cuda.py [--cpu-dry-run] [--result out.json]
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import Checker, main  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import fshard as fs  # noqa: E402
from fshard import P  # noqa: E402

WORLD = 2
TOL = 1e-10


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _mesh(shape: dict[str, int], device_type: str) -> fs.Mesh:
    if device_type == "cuda":  # set (and initialized) before the mesh, which would pick cuda:LOCAL_RANK
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
        torch.cuda.init()
    return fs.make_mesh(shape, device_type=device_type)


def _devices(*trees: Any) -> list[str]:
    return sorted({_local(t).device.type for tree in trees for t in fs.tree.leaves(tree)
                   if isinstance(t, torch.Tensor)})


def _max_diff(a: Any, b: Any) -> float:
    return max(((_local(x).detach().cpu() - y).abs().max().item()
                for x, y in zip(fs.tree.leaves(a), fs.tree.leaves(b))), default=0.0)


# --- collectives ------------------------------------------------------------------------

def collectives_rank(device_type: str) -> dict[str, Any]:
    mesh = _mesh({"x": WORLD}, device_type)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(WORLD * 4, 6, generator=g, dtype=torch.float64)
    blocks = x.chunk(WORLD)
    half = 4 // WORLD

    def body(b):
        return {"psum": fs.lax.psum(b, "x"), "all_gather": fs.lax.all_gather(b, "x", tiled=True),
                "psum_scatter": fs.lax.psum_scatter(b, "x", tiled=True),
                "ppermute": fs.lax.ppermute(b, "x", [(i, (i + 1) % WORLD) for i in range(WORLD)]),
                "all_to_all": fs.lax.all_to_all(b, "x", 0, 0, tiled=True)}

    specs = {"psum": P(), "all_gather": P(), "psum_scatter": P("x"), "ppermute": P("x"), "all_to_all": P("x")}
    with fs.comm_log() as log:
        out = fs.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=specs, check=False)(x)
    total = sum(blocks)
    want = {"psum": total, "all_gather": x, "psum_scatter": total,
            "ppermute": torch.cat([blocks[(i - 1) % WORLD] for i in range(WORLD)]),
            "all_to_all": torch.cat([b[r * half:(r + 1) * half] for r in range(WORLD) for b in blocks])}
    full = {k: fs.gather(v) if hasattr(v, "full_tensor") else v for k, v in out.items()}
    return {"diffs": {k: (full[k].cpu() - want[k]).abs().max().item() for k in want},
            "devices": _devices(out), "counts": dict(log.counts)}


# --- init_sharded -----------------------------------------------------------------------

def init_rank(device_type: str) -> dict[str, Any]:
    from check_init_sharded import init_and_measure

    mesh = _mesh({"fsdp": WORLD}, device_type)
    return init_and_measure(mesh, seed=11)


# --- FSDP -------------------------------------------------------------------------------

def _mlp_params():
    g = torch.Generator().manual_seed(3)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64) * 0.2
    return {"proj": {"w": rnd(12, 32)}, "layers": [{"w1": rnd(32, 47), "w2": rnd(47, 32)} for _ in range(3)]}


def _mlp_block(lp, h):
    return h + torch.tanh(h @ lp["w1"]) @ lp["w2"]


def _mlp_loss(p, x, y):
    h = x @ p["proj"]["w"]
    for lp in p["layers"]:
        h = _mlp_block(lp, h)
    return ((h - y) ** 2).mean()


def fsdp_rank(device_type: str, steps: int) -> dict[str, Any]:
    mesh = _mesh({"fsdp": WORLD}, device_type)
    params = _mlp_params()
    specs = fs.parallel.fsdp_specs(params, "fsdp")
    sharded = fs.shard(params, specs, mesh, uneven=True)

    def body(p, x, y):
        root = fs.parallel.gather_params(p["proj"], axis="fsdp")
        h = fs.parallel.scan_layers(_mlp_block, p["layers"], x @ root["w"], axis="fsdp")
        return fs.lax.pmean(((h - y) ** 2).mean(), "fsdp")

    step = fs.value_and_grad(fs.shard_map(body, mesh=mesh, in_specs=(specs, P("fsdp"), P("fsdp")), out_specs=P()))
    opt, ref_opt = fs.optim.adam(1e-2), fs.optim.adam(1e-2)
    state, ref, ref_state = opt.init(sharded), params, ref_opt.init(params)
    loss_err = grad_err = param_err = 0.0
    devices: set[str] = set()
    counts = {}
    for s in range(steps):
        g = torch.Generator().manual_seed(50 + s)
        x, y = torch.randn(8, 12, generator=g, dtype=torch.float64), torch.randn(8, 32, generator=g, dtype=torch.float64)
        with fs.comm_log() as log:
            loss, grads = step(sharded, x, y)
        counts = dict(log.counts)
        ref_loss, ref_grads = fs.value_and_grad(_mlp_loss)(ref, x, y)
        loss_err = max(loss_err, abs(float(_local(loss)) - float(ref_loss)))
        grad_err = max(grad_err, _max_diff(fs.gather(grads), ref_grads))
        devices.update(_devices(sharded, grads, loss))
        updates, state = opt.update(grads, state, sharded)
        sharded = fs.optim.apply_updates(sharded, updates)
        ref_updates, ref_state = ref_opt.update(ref_grads, ref_state, ref)
        ref = fs.optim.apply_updates(ref, ref_updates)
        param_err = max(param_err, _max_diff(fs.gather(sharded), ref))
    return {"loss_err": loss_err, "grad_err": grad_err, "param_err": param_err, "devices": sorted(devices),
            "counts": counts}


# --- TP ---------------------------------------------------------------------------------

def tp_rank(device_type: str) -> dict[str, Any]:
    from fshard.models import TransformerConfig, block, embed, head, transformer_init
    from fshard.parallel import (TRANSFORMER_TP_PLAN, tp_embed, tp_logits, tp_specs, tp_transformer_block,
                                 vocab_parallel_cross_entropy)

    mesh = _mesh({"tp": WORLD}, device_type)
    cfg = TransformerConfig(vocab_size=32, dim=16, n_layers=2, n_heads=4, max_seq_len=8)
    params = transformer_init(cfg, 42, dtype=torch.float64)
    specs = tp_specs(params, TRANSFORMER_TP_PLAN, "tp")
    sharded = fs.shard(params, specs, mesh)

    def body(p, tok, tgt):
        x = tp_embed(p, tok, cfg, "tp")                                           # (b, T, D)
        for lp in p["layers"]:
            x = tp_transformer_block(lp, x, cfg, "tp")
        return vocab_parallel_cross_entropy(tp_logits(p, x, cfg, "tp"), tgt, "tp", vocab_size=cfg.vocab_size)

    def ref_loss(p, tok, tgt):
        x = embed(p, tok, cfg)
        for lp in p["layers"]:
            x = block(lp, x, cfg)
        return F.cross_entropy(head(p, x, cfg).flatten(0, 1), tgt.flatten())

    g = torch.Generator().manual_seed(5)
    tok = torch.randint(0, cfg.vocab_size, (4, cfg.max_seq_len), generator=g)
    tgt = torch.roll(tok, -1, dims=1)
    step = fs.value_and_grad(fs.shard_map(body, mesh=mesh, in_specs=(specs, P(), P()), out_specs=P()))
    with fs.comm_log() as log:
        loss, grads = step(sharded, tok, tgt)
    want_loss, want_grads = fs.value_and_grad(ref_loss)(params, tok, tgt)
    return {"loss_err": abs(float(_local(loss)) - float(want_loss)), "grad_err": _max_diff(fs.gather(grads), want_grads),
            "devices": _devices(sharded, grads, loss), "counts": dict(log.counts)}


# --- pipeline ---------------------------------------------------------------------------

D, N_LAYERS, MICRO = 6, 4, 4


def _pp_params():
    g = torch.Generator().manual_seed(9)
    return {str(i): {"weight": torch.randn(D, D, generator=g, dtype=torch.float64) / D ** 0.5,
                     "bias": torch.randn(D, generator=g, dtype=torch.float64) * 0.1} for i in range(N_LAYERS)}


def _pp_layers(params, x):
    for key in sorted(params, key=int):
        x = torch.tanh(x @ params[key]["weight"].T + params[key]["bias"])
    return x


def _pp_stage(params, x, stage):
    return _pp_layers(params, x)


def _pp_loss(y, t):
    return ((y - t) ** 2).mean()


def pipeline_rank(device_type: str) -> dict[str, Any]:
    mesh = _mesh({"pp": WORLD}, device_type)
    rank = mesh.axis_index("pp")
    dev = mesh.device
    params = _pp_params()
    sch = fs.sched.one_f_one_b(WORLD, MICRO)
    per = N_LAYERS // sch.n_stages
    stage_params = [{str(i): fs.tree.tree_map(lambda t: t.to(dev), params[str(i)])
                     for i in range(s * per, (s + 1) * per)} if s in sch.stages_of(rank) else None
                    for s in range(sch.n_stages)]
    g = torch.Generator().manual_seed(13)
    x, y = torch.randn(2 * MICRO, D, generator=g, dtype=torch.float64), torch.randn(2 * MICRO, D, generator=g,
                                                                                      dtype=torch.float64)
    with fs.comm_log() as log:
        loss, grads = fs.sched.pipeline_step(_pp_stage, _pp_loss, stage_params, (x.to(dev), y.to(dev)),
                                             schedule=sch, mesh=mesh, axis="pp")
    want_loss, want_grads = fs.value_and_grad(lambda p: _pp_loss(_pp_layers(p, x), y))(params)
    held = [(entry, s) for s, entry in enumerate(grads) if entry is not None]
    grad_err = max(_max_diff(entry, {k: want_grads[k] for k in entry}) for entry, _ in held)
    return {"loss_err": abs(float(loss) - float(want_loss)), "grad_err": grad_err,
            "devices": _devices([e for e, _ in held], loss), "counts": dict(log.counts)}


# --- torch's own gloo collectives on CUDA tensors (a probe, no assertion) ---------------

RAW_OPS = ("all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single",
           "functional_all_gather", "dtensor_full_tensor")


def raw_op_rank(device_type: str, op: str) -> bool:
    """One torch collective on ``device_type`` tensors over gloo, without fshard's host
    staging; True when its result is right (a crash kills the ranks)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = _mesh({"x": WORLD}, device_type)
    group, me = mesh.group("x"), dist.get_rank()
    dev = torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    x = torch.arange(8.0, device=dev) + 10 * me
    every = [torch.arange(8.0) + 10 * r for r in range(WORLD)]
    if op == "all_reduce":
        dist.all_reduce(x, group=group)
        want = sum(every)
    elif op == "broadcast":
        dist.broadcast(x, dist.get_global_rank(group, 0), group=group)
        want = every[0]
    elif op == "all_gather_into_tensor":
        out = torch.empty(8 * WORLD, device=dev)
        dist.all_gather_into_tensor(out, x, group=group)
        x, want = out, torch.cat(every)
    elif op == "reduce_scatter_tensor":
        out = torch.empty(8 // WORLD, device=dev)
        dist.reduce_scatter_tensor(out, x, group=group)
        x, want = out, sum(every).chunk(WORLD)[me]
    elif op == "all_to_all_single":
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        x, want = out, torch.cat([e.chunk(WORLD)[me] for e in every])
    elif op == "functional_all_gather":
        f = torch.ops._c10d_functional
        x, want = f.wait_tensor(f.all_gather_into_tensor(x, WORLD, group.group_name)), torch.cat(every)
    else:
        full = torch.cat(every).to(dev)
        x, want = distribute_tensor(full, mesh.device_mesh, [Shard(0)]).full_tensor(), torch.cat(every)
    return bool(torch.equal(x.cpu(), want))


def probe_raw_ops(ck: Checker, dt: str, timeout: float) -> None:
    """Which of torch's gloo collectives survive CUDA tensors (figures only: fshard stages
    them all through the host, and the parts below assert its results)."""
    outcome = {}
    for op in RAW_OPS:
        try:
            ok = fs.run_local(raw_op_rank, dt, op, world_size=WORLD, timeout_s=min(timeout, 60.0))
            outcome[op] = "ok" if all(ok) else "wrong result"
        except Exception as e:  # noqa: BLE001 - a crash here is the finding, not a failure of the check
            outcome[op] = "failed: " + (str(e).splitlines() or ["?"])[0][:120]
    ck.figure(torch_gloo_on_device=outcome)


# --- the check --------------------------------------------------------------------------

def _require_parity(ck: Checker, name: str, results: list[dict[str, Any]], keys: tuple[str, ...]) -> None:
    worst = {k: max(r[k] for r in results) for k in keys}
    ck.figure(**{f"{name}_{k}": v for k, v in worst.items()}, **{f"{name}_collectives": results[0]["counts"]})
    ck.require(f"{name}: {WORLD} gloo ranks equal one process (float64, {TOL})",
               all(v <= TOL for v in worst.values()), worst)
    devices = sorted({d for r in results for d in r["devices"]})
    ck.require_on_device(f"{name}: shards, gradients and results on CUDA", lambda: (devices == ["cuda"], devices))


def run(ck: Checker, args: argparse.Namespace) -> None:
    dt, t = ck.device_type, args.timeout
    probe_raw_ops(ck, dt, t)

    with ck.part("collectives"):
        results = fs.run_local(collectives_rank, dt, world_size=WORLD, timeout_s=t)
        worst = {k: max(r["diffs"][k] for r in results) for k in results[0]["diffs"]}
        ck.figure(collectives_max_diff=max(worst.values()), collectives_counts=results[0]["counts"])
        ck.require("collectives: psum, all_gather, psum_scatter, ppermute, all_to_all over 2 ranks are exact",
                   all(v == 0.0 for v in worst.values()), worst)
        devices = sorted({d for r in results for d in r["devices"]})
        ck.require_on_device("collectives: results on CUDA", lambda: (devices == ["cuda"], devices))

    with ck.part("init_sharded"):
        from check_init_sharded import require_init

        results = fs.run_local(init_rank, dt, world_size=WORLD, timeout_s=t)
        r0 = results[0]
        ck.figure(init_local_bytes=[r["local_bytes"] for r in results], init_total_bytes=r0["total_bytes"],
                  init_max_param_bytes=r0["max_param_bytes"],
                  init_device_peak_rise_bytes=[r["device_peak_rise_bytes"] for r in results])
        ck.require("init_sharded: the memory bound is below the whole model (so the check can fail)",
                   all(r["device_bound_bytes"] < r["total_bytes"] for r in results),
                   [(r["device_bound_bytes"], r["total_bytes"]) for r in results])
        for i, r in enumerate(results):
            require_init(ck, r, f"init_sharded rank {i}/{WORLD}")

    with ck.part("fsdp"):
        _require_parity(ck, "fsdp", fs.run_local(fsdp_rank, dt, args.steps, world_size=WORLD, timeout_s=t),
                        ("loss_err", "grad_err", "param_err"))
    with ck.part("tp"):
        _require_parity(ck, "tp", fs.run_local(tp_rank, dt, world_size=WORLD, timeout_s=t), ("loss_err", "grad_err"))
    with ck.part("pipeline"):
        _require_parity(ck, "pipeline", fs.run_local(pipeline_rank, dt, world_size=WORLD, timeout_s=t),
                        ("loss_err", "grad_err"))


def _args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--steps", type=int, default=2, help="FSDP optimizer steps")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per part")


if __name__ == "__main__":
    main(run, "gloo_cuda_ranks", _args, doc=__doc__)
