"""Rank bodies for the plan tests (module level: the worker pools import them by reference)."""

from __future__ import annotations


def train_lm():
    from _harness._examples import example

    return example("train_lm")


def traced_step(argv: list[str]) -> dict:
    """Builds examples/train_lm.py's step for ``argv`` on this rank, runs one step, then
    one more under ``fs.comm_log``; returns ``{(kind, axes): (calls, bytes)}`` and the
    pp rank."""
    import torch.distributed as dist

    import fshard as fs
    from fshard.recipes.step import compose_train_step

    T = train_lm()
    args = T.parse_args(argv)
    mesh = fs.make_mesh(T.parse_mesh(args.mesh, dist.get_world_size()))
    corpus = T.CharCorpus.load(args.data)
    cfg = T.model_config(args, corpus)
    microbatches = args.microbatches or (2 * mesh.shape["pp"] if "pp" in mesh.shape else 1)
    layout = T.plan_layout(args, dict(mesh.shape), microbatches)
    moe = fs.recipes.MoE(args.moe) if args.moe else None
    composed = compose_train_step(fs.recipes.transformer(cfg, moe), layout, T.make_optimizer(args), mesh=mesh,
                                  max_norm=args.grad_clip)
    params, state = composed.init_state(args.seed)
    step = composed.step
    tokens, targets = corpus.batch(0, args.batch_size, args.seq_len, args.seed)
    params, state = step(params, state, tokens, targets)[:2]
    with fs.comm_log() as log:
        step(params, state, tokens, targets)
    totals = {(k, a): (n, log.bytes_by_axis[(k, a)]) for (k, a), n in log.by_axis.items()}
    pp_rank = mesh.axis_index("pp") if "pp" in mesh.axis_names else 0
    return {"totals": totals, "pp_rank": pp_rank, "vocab": cfg.vocab_size}


def train(argv: list[str]) -> list[dict]:
    """examples/train_lm.py's main on this rank."""
    return train_lm().main(argv)
