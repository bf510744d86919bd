"""fs.jit's capture side: the signature of a call's tensors (what a recompile is keyed on and
why it happened), replaying a trace's collectives, and the capture error with its user frame."""

from __future__ import annotations

import os
import sysconfig
import traceback

import torch
from torch.distributed.tensor import DTensor

from fshard import comm
from fshard import tree as tree_util


class JitCaptureError(RuntimeError):
    """The function could not be captured as one graph (the message says where and why)."""


def _local(x: torch.Tensor) -> torch.Tensor:
    return x.to_local() if isinstance(x, DTensor) else x


def _tensor_sig(x: torch.Tensor) -> tuple:
    if isinstance(x, DTensor):
        spec, loc = x._spec, x._local_tensor
        meta = spec.tensor_meta
        if meta is None:  # a spec without its tensor's metadata: ask the DTensor
            return (
                "dtensor",
                tuple(x.shape),
                x.stride(),
                x.dtype,
                spec.mesh,
                spec.placements,
                tuple(loc.shape),
                loc.stride(),
            )
        return (
            "dtensor",
            tuple(meta.shape),
            meta.stride,
            meta.dtype,
            spec.mesh,
            spec.placements,
            tuple(loc.shape),
            loc.stride(),
        )
    return ("tensor", tuple(x.shape), x.stride(), x.dtype, x.device)


def _paths(args: tuple, kwargs: dict) -> list[str]:
    """Each leaf's path in the call, as a message names it (``args[0].w``, ``kwargs.lr``)."""
    raw, _, _ = tree_util.tree_flatten_with_path((args, kwargs))
    return [_path(p) for p in raw]


def _path(p) -> str:
    s = tree_util.keystr(p)
    # (args, kwargs): "0.1.w" -> "args[1].w"; "1.lr" -> "kwargs.lr"
    head, _, rest = s.partition(".")
    if head == "0":
        i, _, rest = rest.partition(".")
        return f"args[{i}]" + (f".{rest}" if rest else "")
    return f"kwargs.{rest}" if rest else "kwargs"


_FIELDS = {
    "tensor": ("shape", "stride", "dtype", "device"),
    "dtensor": ("shape", "stride", "dtype", "mesh", "placements", "local shape", "local stride"),
    "static": ("type", "value"),
}


def _why(key: tuple, paths: list[str], old: list[tuple]) -> str:
    """What differs between ``key`` and the closest cached signature, leaf by leaf."""
    treedef, sig, grad, aliases = key
    same_tree = [k for k in old if k[0] == treedef]
    if not same_tree:
        return "the argument structure changed (new pytree: %s)" % (treedef,)
    best_diff = None
    for k in same_tree:
        diff = []
        if k[2] != grad:
            diff.append(f"grad mode {k[2]} -> {grad}")
        if k[3] != aliases:
            diff.append(f"tensors passed more than once (leaf, same as leaf) {k[3]} -> {aliases}")
        for path, a, b in zip(paths, k[1], sig):
            if a == b:
                continue
            if a[0] != b[0]:
                diff.append(f"{path}: {a[0]} -> {b[0]}")
                continue
            for name, u, v in zip(_FIELDS[a[0]], a[1:], b[1:]):
                if u != v:
                    diff.append(f"{path}: {name} {u} -> {v}")
        if best_diff is None or len(diff) < len(best_diff):
            best_diff = diff
    return "; ".join(best_diff or ()) or "no difference found (equal signature, unhashable equality?)"


def _replay(timeline: tuple) -> None:
    """Replays a traced call's collectives into the active comm logs (as eager logs them)."""
    if not comm._LOGS.get():
        return
    for ev in timeline:
        if ev.what == "issue":
            comm.record(ev.kind, ev.axes, ev.nbytes, wire=ev.wire)
        else:
            comm._append(ev)


_JIT_DIR = os.path.dirname(os.path.abspath(__file__))  # fshard/jit
_OUR_DIR = os.path.dirname(_JIT_DIR)  # fshard
# Frames in these are not "the user's line": torch, installed packages, the standard library.
_LIB_DIRS = tuple(
    {os.path.dirname(os.path.abspath(torch.__file__))}
    | {sysconfig.get_paths()[k] for k in ("purelib", "platlib", "stdlib")}
)


def _capture_message(name: str, stage: str, e: BaseException) -> str:
    """Names the cause and the innermost line of user code (else of fshard) it came from."""
    frames = traceback.extract_tb(e.__traceback__)
    user = [fr for fr in frames if not fr.filename.startswith(_LIB_DIRS + (_OUR_DIR,)) and "<" not in fr.filename]
    ours = [fr for fr in frames if fr.filename.startswith(_OUR_DIR) and not fr.filename.startswith(_JIT_DIR)]
    where = user[-1] if user else (ours[-1] if ours else None)
    line = f"{where.filename}:{where.lineno}: {where.line}" if where else "(no Python line found)"
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()][:3]
    cause = f"{type(e).__name__}: " + " / ".join(lines)[:600]
    hint = ""
    text = str(e)
    if (
        any(
            s in text
            for s in (
                "data-dependent",
                "Data dependent",
                "DataDependent",
                "item()",
                "data pointer",
                "GuardOnDataDependent",
                "unbacked",
            )
        )
        or "DataDependent" in type(e).__name__
    ):
        hint = (
            "\nThe function reads a tensor's value in Python (.item(), bool(t), if/while on a tensor, "
            "printing it): fs.jit traces without values. Compute it with tensor ops (torch.where), "
            "move it out of the jitted function, or pass on_capture_error='eager'."
        )
    elif stage == "trace" and ("convert all Tensors to FakeTensors" in text or "non-Fake Tensor" in text):
        hint = (
            "\nThe function uses a tensor it does not take as an argument (a tensor it closes over, or a "
            "module's parameter or buffer, e.g. one fs.nn.functionalize left on the module): fs.jit traces "
            "its arguments only and bakes in no tensor as a constant, since a torch tensor can change in "
            "place between calls. Pass that tensor as an argument (in the params or buffers pytree)."
        )
    return f"fs.jit({name}) could not {stage} the function: {cause}\n  at {line}{hint}"
