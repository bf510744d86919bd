"""Result records and their comparison (numpy only: used by the JAX process too).

A record is a dict: ``{"status": "ok", "value": pytree of numpy arrays}`` or
``{"status": "error", "error": "Type: message"}``; the fshard side adds
``"ranks_disagree"`` when some rank's global result differs from rank 0's.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

RTOL = ATOL = 1e-12


def tree_map(fn: Callable[[Any], Any], tree: Any) -> Any:
    """Maps ``fn`` over the leaves of nested dicts / tuples / lists."""
    if isinstance(tree, dict):
        return {k: tree_map(fn, v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [tree_map(fn, v) for v in tree]
    if isinstance(tree, tuple):  # namedtuples too, as plain tuples
        return tuple(tree_map(fn, v) for v in tree)
    return fn(tree)


def flatten(tree: Any, path: str = "") -> list[tuple[str, Any]]:
    """``[(path, leaf)]`` with paths like ``dx.tiled_axis0`` or ``grads.1.w``."""
    if isinstance(tree, dict):
        # Sorted keys: JAX returns dicts with sorted keys, fshard in insertion order.
        return [kv for k in sorted(tree) for kv in flatten(tree[k], f"{path}.{k}" if path else str(k))]
    if isinstance(tree, (tuple, list)):
        return [kv for i, v in enumerate(tree) for kv in flatten(v, f"{path}.{i}" if path else str(i))]
    return [(path or "<root>", tree)]


def ok(value: Any) -> dict:
    return {"status": "ok", "value": value}


def error(e: BaseException) -> dict:
    return {"status": "error", "error": f"{type(e).__name__}: {e}"[:4000]}


def _fmt(a: Any) -> str:
    if a is None:
        return "None"
    return np.array2string(np.asarray(a), precision=6, threshold=12, edgeitems=3, max_line_width=160)


def leaf_mismatches(actual: Any, expected: Any, *, scale: float = 1.0) -> list[str]:
    """Differences between two pytrees of arrays (``expected * scale`` vs ``actual``)."""
    a_flat, e_flat = flatten(actual), flatten(expected)
    a_paths, e_paths = [p for p, _ in a_flat], [p for p, _ in e_flat]
    if a_paths != e_paths:
        return [f"structure differs: fshard leaves {a_paths} vs JAX leaves {e_paths}"]
    out = []
    for (path, a), (_, e) in zip(a_flat, e_flat):
        if a is None or e is None:
            if (a is None) != (e is None):
                out.append(f"{path}: fshard {_fmt(a)} vs JAX {_fmt(e)}")
            continue
        a, e = np.asarray(a), np.asarray(e)
        if a.shape != e.shape:
            out.append(f"{path}: shape fshard {a.shape} vs JAX {e.shape}")
            continue
        e = e.astype(np.float64) * scale
        a = a.astype(np.float64)
        if not np.allclose(a, e, rtol=RTOL, atol=ATOL):
            diff = float(np.max(np.abs(a - e))) if a.size else 0.0
            out.append(f"{path}: max |diff| {diff:.3g}\n    JAX    {_fmt(e)}\n    fshard {_fmt(a)}")
    return out


def mismatch(name: str, fs_rec: dict, jax_rec: dict) -> str | None:
    """Why fshard's record does not conform to JAX's, or ``None``.

    Both raising counts as conforming (e.g. pmax has no gradient in either).
    """
    if fs_rec.get("ranks_disagree"):
        return f"{name}: fshard's ranks disagree on the global result: {fs_rec['ranks_disagree']}"
    if fs_rec["status"] == "error" and jax_rec["status"] == "error":
        return None
    if fs_rec["status"] != jax_rec["status"]:
        return (f"{name}: JAX {'returned' if jax_rec['status'] == 'ok' else 'raised'}, fshard "
                f"{'returned' if fs_rec['status'] == 'ok' else 'raised'}\n"
                f"  JAX:    {jax_rec.get('error') or _summary(jax_rec['value'])}\n"
                f"  fshard: {fs_rec.get('error') or _summary(fs_rec['value'])}")
    problems = leaf_mismatches(fs_rec["value"], jax_rec["value"])
    if problems:
        return f"{name}: fshard differs from JAX (rtol=atol={RTOL}):\n  " + "\n  ".join(problems)
    return None


def _summary(tree: Any) -> str:
    return "; ".join(f"{p}={_fmt(v)}" for p, v in flatten(tree))[:2000]
