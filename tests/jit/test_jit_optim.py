"""fs.jit of an fs.optim update under Inductor: the AdamW step is fused (issue 17: "fuse the
optimizer: one pass over each shard for AdamW"), read from the generated code.

One process, three small float32 leaves, one Inductor compile (a few seconds). What the
code must show:

- no ``_foreach_zero``: the update buffers' zeros are folded into the kernel that writes
  them (fshard.optim.transforms._zeros_like_each), not written by an aten pass first;
- the bias corrections' ``pow`` (one for b1, one for b2) computed once per step, outside
  the per-element loops (fshard.optim.transforms._computed_once: inlined, Inductor
  computed them again for every 16 elements of every leaf);
- one loop over each leaf: moments, denominator, update and the new parameter in one pass.
"""

import re
from collections import Counter

import pytest
import torch

import fshard as fs
from fshard.testing import inductor_output_code

F32 = torch.float32
# Sizes no two leaves share, none of them 1 or 2 (the loops over the (2, 2) scalar buffer).
_SHAPES = {"a": (33,), "b": (4, 5), "c": (7,)}
_LOOP = re.compile(r"for\(int64_t x0=static_cast<int64_t>\(0L\); x0<static_cast<int64_t>\((\d+)L\);")


def _loops(code: str) -> list[tuple[int, str]]:
    """Each ``for`` loop over ``x0`` in the C++ code: its trip count and its body's text."""
    out = []
    for m in _LOOP.finditer(code):
        start = code.index("{", m.end())
        depth, i = 0, start
        while True:
            depth += {"{": 1, "}": -1}.get(code[i], 0)
            if depth == 0:
                break
            i += 1
        out.append((int(m.group(1)), code[start:i + 1]))
    return out


@pytest.mark.timeout(240)  # a cold Inductor compile on a loaded machine
def test_jit_inductor_fuses_adamw_one_loop_per_leaf_bias_correction_once_float32():
    g = torch.Generator().manual_seed(0)
    params = {k: torch.randn(s, generator=g, dtype=F32) for k, s in _SHAPES.items()}
    grads = [{k: torch.randn(s, generator=g, dtype=F32) for k, s in _SHAPES.items()} for _ in range(3)]
    opt = fs.optim.adamw(1e-2, weight_decay=0.1)

    def step(p, s, gr):
        u, s = opt.update(gr, s, p)
        return fs.optim.apply_updates(p, u), s

    jstep = fs.jit(step)  # Inductor
    ep, es, jp, js = params, opt.init(params), params, opt.init(params)
    with inductor_output_code() as codes:
        for gr in grads:  # 3 steps: the bias corrections differ from step to step
            ep, es = step(ep, es, gr)
            jp, js = jstep(jp, js, gr)
    assert jstep.cache_size == 1 and len(codes) == 1, (jstep.cache_size, len(codes))
    for k in _SHAPES:
        torch.testing.assert_close(jp[k], ep[k], rtol=1e-6, atol=1e-6)
        assert not torch.equal(jp[k], params[k]), k
    for a, b in zip(fs.tree.leaves(js), fs.tree.leaves(es)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)

    code = codes[0]
    assert "_foreach_zero" not in code
    loops = _loops(code)
    # Exactly one loop per leaf (the others run over the scalars' (2, 2) buffer).
    per_leaf = Counter(n for n, _ in loops if n > 2)
    assert per_leaf == Counter(torch.Size(s).numel() for s in _SHAPES.values()), per_leaf
    assert code.count("std::pow") == 2, code.count("std::pow")
    assert not [n for n, body in loops if "pow" in body], [n for n, body in loops if "pow" in body]
