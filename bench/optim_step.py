"""One optimizer step: fs.optim.adamw vs torch.optim.AdamW(foreach=True), same params.

One process, plain tensors, ~3.5M float32 parameters shaped like a small transformer
(4 layers of d=256: attention, a 4x MLP, norms, embeddings). Both step on the same
gradients; the two runs alternate so that machine noise hits both alike.

    PYTHONPATH=. python bench/optim_step.py [--threads 1] [--steps 50] [--compiled [--backend inductor]]

Prints the median step time of each and the ratio fshard / torch (< 1: fshard is faster).
``--compiled`` adds, in the same rounds, torch's step compiled (``torch.compile(opt.step)``,
torch's "compiling the optimizer" recipe) and fshard's pure update under ``fs.jit`` (one
graph over every leaf; no ``donate()``: a jitted function is pure), each with its first
call's time (trace + compile).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import fshard.optim as optim
from fshard import tree as tree_util


def make_params(d: int = 256, n_layers: int = 4, vocab: int = 1024, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)

    def t(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.02

    layer = lambda: {
        "wq": t(d, d), "wk": t(d, d), "wv": t(d, d), "wo": t(d, d),
        "w1": t(d, 4 * d), "w2": t(4 * d, d), "ln1": t(d), "ln2": t(d),
    }
    return {"embed": t(vocab, d), "pos": t(512, d), "layers": [layer() for _ in range(n_layers)],
            "ln_f": t(d)}


def run(threads: int, steps: int, compiled: bool = False, backend: str = "inductor",
        sizes: dict | None = None, cpu: bool = False) -> tuple[dict[str, float], int, int, dict[str, float]]:
    """Times every side, interleaved; returns ``(median ms per step, params, tensors, first)``,
    ``first``: each compiled side's first call in seconds (trace + compile + one step).
    ``sizes``: :func:`make_params`'s arguments (default: the bench size). ``cpu``: time
    with this thread's CPU clock instead of the wall clock (a shared machine's load then
    moves the figures less; one thread, so they are the step's whole work)."""
    torch.set_num_threads(threads)

    params = make_params(**(sizes or {}))
    n = sum(x.numel() for x in tree_util.leaves(params))
    grads = tree_util.tree_map(lambda x: torch.randn_like(x) * 1e-3, params)
    hp = dict(lr=1e-3, weight_decay=0.1)

    # torch: parameters with .grad set once (step does not clear it).
    torch_params = [x.clone().requires_grad_() for x in tree_util.leaves(params)]
    for p, g in zip(torch_params, tree_util.leaves(grads)):
        p.grad = g.clone()
    topt = torch.optim.AdamW(torch_params, foreach=True, **hp)
    # torch's fused CPU kernel (one pass over each tensor), over its own copies.
    fused_params = [x.detach().clone().requires_grad_() for x in torch_params]
    for p, q in zip(fused_params, torch_params):
        p.grad = q.grad.clone()
    fopt = torch.optim.AdamW(fused_params, fused=True, **hp)

    opt = optim.adamw(**hp)
    state = {"params": params, "opt": opt.init(params)}

    def fs_step() -> None:
        updates, state["opt"] = opt.update(grads, state["opt"], state["params"])
        state["params"] = optim.apply_updates(state["params"], updates)

    def fs_step_donated() -> None:
        with optim.donate():
            fs_step()

    # fs.optim.step on torch's fused kernel (donates the state and params it is given).
    fused_opt = optim.adamw(fused=True, **hp)
    fz = {"params": tree_util.tree_map(torch.clone, params)}
    fz["opt"] = fused_opt.init(fz["params"])

    def fs_fused_step() -> None:
        fz["params"], fz["opt"] = optim.step(fused_opt, grads, fz["opt"], fz["params"])

    runs = [("torch", topt.step), ("torch fused", fopt.step), ("fshard", fs_step), ("fshard donated", fs_step_donated),
            ("fshard fused", fs_fused_step)]
    if compiled:
        import fshard as fs

        # A second torch optimizer over its own copies: compiling one's step must not
        # change the eager one's.
        ctorch_params = [x.detach().clone().requires_grad_() for x in torch_params]
        for p, q in zip(ctorch_params, torch_params):
            p.grad = q.grad.clone()
        copt = torch.optim.AdamW(ctorch_params, foreach=True, **hp)
        ctorch_step = torch.compile(copt.step, backend=backend)

        def pure_update(p, s, g):
            updates, s = opt.update(g, s, p)
            return optim.apply_updates(p, updates), s

        jitted = fs.jit(pure_update, backend=backend)
        jstate = {"params": params, "opt": opt.init(params)}

        def jit_step() -> None:
            jstate["params"], jstate["opt"] = jitted(jstate["params"], jstate["opt"], grads)

        # JAX's donation: the new params and state are computed into the old ones' buffers.
        djitted = fs.jit(pure_update, backend=backend, donate_argnums=(0, 1))
        dstate = {"params": tree_util.tree_map(torch.clone, params), "opt": opt.init(params)}

        def jit_donated_step() -> None:
            dstate["params"], dstate["opt"] = djitted(dstate["params"], dstate["opt"], grads)

        runs += [("torch compiled", ctorch_step), ("fshard jit", jit_step), ("fshard jit donated", jit_donated_step)]
    times: dict[str, list[float]] = {name: [] for name, _ in runs}
    first: dict[str, float] = {}
    clock = time.thread_time if cpu else time.perf_counter
    for i in range(steps + 5):
        for name, fn in runs:
            t0 = clock()
            fn()
            if i == 0 and name.endswith(("compiled", "jit", "donated")) and name not in ("fshard donated",):
                first[name] = clock() - t0
            if i >= 5:  # warm-up: allocator, first-step state creation, compiling
                times[name].append(clock() - t0)
    # The same updates on every side, or the timing compares different work.
    torch.testing.assert_close(tree_util.leaves(fz["params"]), [x.detach() for x in fused_params])
    if compiled:
        for got, want in ((ctorch_params, torch_params), (fused_params, torch_params),
                          (tree_util.leaves(jstate["params"]), torch_params),
                          (tree_util.leaves(dstate["params"]), torch_params)):
            torch.testing.assert_close([x.detach() for x in got], [x.detach() for x in want])
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    return med, n, len(torch_params), first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--compiled", action="store_true", help="also time torch.compile(opt.step) and fs.jit(update)")
    ap.add_argument("--backend", default="inductor", help="the torch.compile backend of --compiled's sides")
    ap.add_argument("--cpu-clock", action="store_true", help="this thread's CPU time instead of wall time")
    args = ap.parse_args()
    if args.cpu_clock and args.threads > 1:
        ap.error("--cpu-clock reads this thread's CPU time, which misses the other intra-op threads: use --threads 1")
    med, n, n_tensors, first = run(args.threads, args.steps, args.compiled, args.backend, cpu=args.cpu_clock)
    print(f"params: {n / 1e6:.2f}M in {n_tensors} tensors, threads={args.threads}, "
          f"steps={args.steps}")
    print(f"clock: {'thread CPU time' if args.cpu_clock else 'wall'}")
    print(f"torch.optim.AdamW(foreach=True):        {med['torch']:.2f} ms/step")
    print(f"torch.optim.AdamW(fused=True):          {med['torch fused']:.2f} ms/step")
    print(f"fs.optim.adamw (pure):                  {med['fshard']:.2f} ms/step")
    print(f"fs.optim.adamw (with fs.optim.donate()): {med['fshard donated']:.2f} ms/step")
    print(f"fs.optim.step(adamw(fused=True)):       {med['fshard fused']:.2f} ms/step")
    print(f"ratio fshard/torch: pure {med['fshard'] / med['torch']:.2f}, "
          f"donated {med['fshard donated'] / med['torch']:.2f}; "
          f"fused / torch fused {med['fshard fused'] / med['torch fused']:.2f}")
    if args.compiled:
        print(f"torch.compile(opt.step) ({args.backend}):   {med['torch compiled']:.2f} ms/step, "
              f"first call {first['torch compiled']:.1f} s")
        print(f"fs.jit(adamw update) ({args.backend}):      {med['fshard jit']:.2f} ms/step, "
              f"first call {first['fshard jit']:.1f} s")
        print(f"fs.jit(adamw update, donate_argnums=(0, 1)): {med['fshard jit donated']:.2f} ms/step, "
              f"first call {first['fshard jit donated']:.1f} s")
        print(f"ratio fs.jit / torch compiled: {med['fshard jit'] / med['torch compiled']:.2f}; "
              f"fs.jit / torch eager: {med['fshard jit'] / med['torch']:.2f}; "
              f"fs.jit / torch fused: {med['fshard jit'] / med['torch fused']:.2f}; "
              f"donated / torch fused: {med['fshard jit donated'] / med['torch fused']:.2f}")


if __name__ == "__main__":
    main()
