"""One optimizer step: fs.optim.adamw vs torch.optim.AdamW(foreach=True), same params.

One process, plain tensors, ~3.5M float32 parameters shaped like a small transformer
(4 layers of d=256: attention, a 4x MLP, norms, embeddings). Both step on the same
gradients; the two runs alternate so that machine noise hits both alike.

    PYTHONPATH=. python bench/optim_step.py [--threads 1] [--steps 50]

Prints the median step time of each and the ratio fshard / torch (< 1: fshard is faster).
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=50)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    params = make_params()
    n = sum(x.numel() for x in tree_util.leaves(params))
    grads = tree_util.tree_map(lambda x: torch.randn_like(x) * 1e-3, params)
    hp = dict(lr=1e-3, weight_decay=0.1)

    # torch: parameters with .grad set once (step does not clear it).
    torch_params = [x.clone().requires_grad_() for x in tree_util.leaves(params)]
    for p, g in zip(torch_params, tree_util.leaves(grads)):
        p.grad = g.clone()
    topt = torch.optim.AdamW(torch_params, foreach=True, **hp)

    opt = optim.adamw(**hp)
    state = {"params": params, "opt": opt.init(params)}

    def fs_step() -> None:
        updates, state["opt"] = opt.update(grads, state["opt"], state["params"])
        state["params"] = optim.apply_updates(state["params"], updates)

    def fs_step_donated() -> None:
        with optim.donate():
            fs_step()

    runs = (("torch", topt.step), ("fshard", fs_step), ("fshard donated", fs_step_donated))
    times: dict[str, list[float]] = {name: [] for name, _ in runs}
    for i in range(args.steps + 5):
        for name, fn in runs:
            t0 = time.perf_counter()
            fn()
            if i >= 5:  # warm-up: allocator, first-step state creation
                times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(f"params: {n / 1e6:.2f}M in {len(torch_params)} tensors, threads={args.threads}, "
          f"steps={args.steps}")
    print(f"torch.optim.AdamW(foreach=True):        {med['torch']:.2f} ms/step")
    print(f"fs.optim.adamw (pure):                  {med['fshard']:.2f} ms/step")
    print(f"fs.optim.adamw (with fs.optim.donate()): {med['fshard donated']:.2f} ms/step")
    print(f"ratio fshard/torch: pure {med['fshard'] / med['torch']:.2f}, "
          f"donated {med['fshard donated'] / med['torch']:.2f}")


if __name__ == "__main__":
    main()
