"""Shrinking a failing program to a minimal one (greedy delta debugging over its data).

Each round builds every one-step simplification of the current program (drop one op with
everything that depends on it, drop an output, drop a differentiated input, simpler
gradient wrapping, no remat, a local loss), runs them all in one batch in both frameworks,
and keeps the smallest that still fails with the same verdict key (e.g.
``mismatch:gradients differ``). It stops when no simplification fails that way.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

SIMPLER_MODE = {"nested_inside": "inside", "nested_outside": "outside", "inside": "none", "outside": "none"}


def _refs(args) -> set[str]:
    return {a for a in args if isinstance(a, str)}


def drop_op(prog: dict, k: int) -> dict | None:
    """``prog`` without op ``k`` and whatever uses its result (None if no output is left)."""
    p = copy.deepcopy(prog)
    gone = {p["ops"][k][0]}
    kept = []
    for i, op in enumerate(p["ops"]):
        if i == k or _refs(op[2]) & gone:
            gone.add(op[0])
        else:
            kept.append(op)
    p["ops"] = kept
    p["outputs"] = [o for o in p["outputs"] if o[0] not in gone]
    return tidy(p) if p["outputs"] else None


def tidy(p: dict) -> dict:
    """Drops the inputs nothing uses, and differentiated inputs that are gone (dead ops
    stay: one may be what fails; dropping it is a candidate of its own)."""
    live = {o for o, _ in p["outputs"]}.union(*[_refs(op[2]) for op in p["ops"]])
    p["inputs"] = [i for i in p["inputs"] if i[0] in live]
    g = p["grad"]
    if g["mode"] != "none":
        g["wrt"] = [w for w in g["wrt"] if w in live]
        if not g["wrt"]:
            p["grad"] = {"mode": "none"}
    return p


def candidates(prog: dict) -> list[dict]:
    """Every one-step simplification of ``prog``."""
    out = [drop_op(prog, k) for k in range(len(prog["ops"]))]
    for j in range(len(prog["outputs"])):
        if len(prog["outputs"]) > 1:
            p = copy.deepcopy(prog)
            del p["outputs"][j]
            out.append(tidy(p))
    g = prog["grad"]
    if g["mode"] != "none":
        p = copy.deepcopy(prog)
        p["grad"] = {**g, "mode": SIMPLER_MODE[g["mode"]]} if SIMPLER_MODE[g["mode"]] != "none" else {"mode": "none"}
        out.append(p)
        if len(g["wrt"]) > 1:
            for w in g["wrt"]:
                p = copy.deepcopy(prog)
                p["grad"]["wrt"] = [x for x in g["wrt"] if x != w]
                out.append(p)
        for key, simple in (("loss", "local"), ("vg", False)):
            if g.get(key) != simple:
                p = copy.deepcopy(prog)
                p["grad"][key] = simple
                out.append(p)
    if prog.get("remat"):
        out.append(dict(copy.deepcopy(prog), remat=None))
    return [p for p in out if p is not None]


def size(prog: dict) -> tuple:
    g = prog["grad"]
    return (len(prog["ops"]), len(prog["outputs"]), len(prog["inputs"]), g["mode"] != "none",
            g["mode"].startswith("nested"), len(g.get("wrt", ())), bool(prog.get("remat")))


def shrink(prog: dict, key: str, judge: Callable[[list[dict]], dict], max_rounds: int = 30) -> dict:
    """The smallest program found that ``judge`` (``{id: verdict key}`` for a batch) still
    gives ``key``."""
    best = copy.deepcopy(prog)
    for r in range(max_rounds):
        cands = candidates(best)
        for i, c in enumerate(cands):
            c["id"] = f"{prog['id']}~{r}.{i}"
        if not cands:
            break
        keys = judge(cands)
        failing = [c for c in cands if keys[c["id"]] == key]
        if not failing:
            break
        best = min(failing, key=size)
    return best
