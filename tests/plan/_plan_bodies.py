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

    T = train_lm()
    args = T.parse_args(argv)
    mesh = fs.make_mesh(T.parse_mesh(args.mesh, dist.get_world_size()))
    corpus = T.CharCorpus.load(args.data)
    cfg, roles, model, pipe, microbatches = T.configure(args, mesh, corpus)
    params, specs = fs.recipes.step.init_params(model, roles, args.seed, pipe)
    opt = T.make_optimizer(args)
    state = opt.init(params)
    order = {p: i for i, p in enumerate(fs.tree.zip_with_path(params)[0])}
    inject = args.inject_nonfinite  # none: the flag is not given
    recipe = fs.recipes.step
    step = (recipe.make_pipeline_step(model, roles, pipe, opt, args.grad_clip, inject, order) if pipe is not None else
            recipe.make_train_step(model, roles, specs, opt, microbatches, args.grad_clip, inject, order))
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
