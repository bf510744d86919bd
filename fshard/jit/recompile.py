"""``fs.jit``'s recompile limit: a warning at a function's first recompile naming the argument
that changed, and past the limit an error or eager runs.

Why: every new signature traces and compiles the function again (an Inductor compile takes
seconds), and a non-tensor argument is part of the signature by value, so a Python float
that changes each step (a learning rate passed as ``0.1``, ``0.2``, ...) compiled once per
value, silently. ``torch.compile`` stops at 8 compiled versions of a frame
(``torch._dynamo.config.recompile_limit``); fs.jit does the same per jitted function.

The rule (``fs.jit``'s ``recompile_limit`` and ``on_recompile_limit``):

- A function traces at most ``recompile_limit`` signatures (default 8; the keyword, else
  the environment variable ``FSHARD_JIT_RECOMPILE_LIMIT``). Signatures it has traced keep
  running compiled.
- Its first recompile (the second signature) warns once with :class:`JitRecompileWarning`,
  naming each argument that changed (its pytree path and parameter name) and how, with the
  fix for the usual cause (a Python number: pass a tensor).
- A call that needs one signature more raises :class:`JitRecompileLimitError` naming the
  function, the limit and the argument that changed (``on_recompile_limit="raise"``, the
  default), or runs ``f`` eagerly, uncompiled and not cached, warning once
  (``on_recompile_limit="eager"``).
"""

from __future__ import annotations

import inspect
import os
import warnings
from typing import Any, Callable

__all__ = ["JitRecompileWarning", "JitRecompileLimitError", "DEFAULT_LIMIT", "ENV", "Recompiles"]

DEFAULT_LIMIT = 8
ENV = "FSHARD_JIT_RECOMPILE_LIMIT"
_ON_LIMIT = ("raise", "eager")


class JitRecompileWarning(UserWarning):
    """A jitted function compiled again (its first recompile); the message says which argument changed.

    Silence it with ``warnings.filterwarnings("ignore", category=JitRecompileWarning)``
    where a few signatures are expected (e.g. a last, smaller batch)."""


class JitRecompileLimitError(RuntimeError):
    """A jitted function needed more signatures than its ``recompile_limit``."""


def check_options(recompile_limit: Any, on_recompile_limit: Any) -> None:
    """Refuses bad keywords at ``fs.jit(...)``, before any call."""
    if recompile_limit is not None and (
        not isinstance(recompile_limit, int) or isinstance(recompile_limit, bool) or recompile_limit < 1
    ):
        raise ValueError(
            f"fs.jit: recompile_limit={recompile_limit!r}; use an int >= 1 (the most signatures one "
            f"function traces and compiles), or None for ${ENV} or {DEFAULT_LIMIT}."
        )
    if on_recompile_limit not in _ON_LIMIT:
        raise ValueError(f"fs.jit: on_recompile_limit={on_recompile_limit!r}; use 'raise' or 'eager'.")


def resolve_limit(recompile_limit: int | None) -> tuple[int, str]:
    """The limit in force and where it came from (for messages). The environment is read
    at each new signature, not per call: cache hits never get here."""
    if recompile_limit is not None:
        return recompile_limit, f"recompile_limit={recompile_limit}"
    text = os.environ.get(ENV, "").strip()
    if not text:
        return DEFAULT_LIMIT, "the default"
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"fs.jit: {ENV}={text!r}; use an int >= 1 (the most signatures one function traces).")
    return value, f"{ENV}={value}"


# --- what changed ------------------------------------------------------------------------
_TENSOR_FIELDS = {
    "tensor": ("shape", "stride", "dtype", "device"),
    "dtensor": ("shape", "stride", "dtype", "mesh", "placements", "local shape", "local stride"),
}


def _leaf_change(a: tuple, b: tuple) -> str:
    """How one leaf's signature entry changed from ``a`` to ``b`` (entries as in
    ``fshard.jit.capture._tensor_sig``, or ``("static", type, value)``), with the usual fix."""
    if a[0] == "static" and b[0] == "static":
        if a[1] is not b[1]:
            return f"Python {a[1].__name__} {a[2]!r} -> {b[1].__name__} {b[2]!r} is a compile-time constant"
        kind = a[1].__name__
        if a[1] in (int, float, complex):
            return (
                f"Python {kind} {a[2]!r} -> {b[2]!r} is a compile-time constant (each value compiles "
                f"again); pass a tensor (torch.tensor({b[2]!r})) so one graph serves every value"
            )
        return f"{kind} {a[2]!r} -> {b[2]!r} is a compile-time constant (each value compiles again)"
    if a[0] != b[0]:
        return f"{_kind(a)} -> {_kind(b)}"
    diff = [f"{name} {u} -> {v}" for name, u, v in zip(_TENSOR_FIELDS[a[0]], a[1:], b[1:]) if u != v]
    text = ", ".join(diff)
    if any(d.startswith("shape") for d in diff):
        text += " (each new shape compiles again; pad to a few fixed shapes)"
    return text


def _kind(entry: tuple) -> str:
    return f"Python {entry[1].__name__} {entry[2]!r}" if entry[0] == "static" else f"a {entry[0]}"


def changes(key: tuple, old: list[tuple], paths: list[str], label: Callable[[str], str]) -> list[str]:
    """What differs between signature ``key`` and the closest of the cached ``old`` ones:
    one line per changed argument (``label(path)``: how to name it), or the structure."""
    treedef, sig, grad, aliases = key
    same = [k for k in old if k[0] == treedef]
    if not same:
        return [f"the arguments' structure changed (new pytree {treedef})"]
    best: list[str] | None = None
    for k in reversed(same):  # the latest signature wins a tie: "0.8 -> 0.9", not "0.1 -> 0.9"
        diff = [f"{label(p)}: {_leaf_change(a, b)}" for p, a, b in zip(paths, k[1], sig) if a != b]
        if k[2] != grad:
            diff.append(f"grad mode {k[2]} -> {grad}")
        if k[3] != aliases:
            diff.append(f"tensors passed more than once (leaf, same as leaf) {k[3]} -> {aliases}")
        if best is None or len(diff) < len(best):
            best = diff
    return best or ["no difference found (an argument whose equality is not its value?)"]


def labeler(f: Callable) -> Callable[[str], str]:
    """Names a leaf path (``args[1]``, ``args[0].w``, ``kwargs.lr``) by ``f``'s parameter
    too: ``lr (args[1])``, ``params.w (args[0].w)``; the path alone if ``f`` has no
    inspectable signature."""
    try:
        params = [
            p
            for p in inspect.signature(f).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):
        params = []

    def label(path: str) -> str:
        if not path.startswith("args["):
            return path.removeprefix("kwargs.")
        i, _, rest = path[5:].partition("]")
        if i.isdigit() and int(i) < len(params):
            return f"{params[int(i)].name}{rest} ({path})"
        return path

    return label


# --- the per-function state --------------------------------------------------------------
class Recompiles:
    """One jitted function's recompile accounting: :meth:`admit` is asked at each new
    signature, before it is traced."""

    def __init__(self, name: str, f: Callable, recompile_limit: int | None, on_limit: str) -> None:
        self._name, self._f, self._limit, self._on_limit = name, f, recompile_limit, on_limit
        self._warned_first = self._warned_eager = False

    def admit(self, key: tuple, cached: list[tuple], paths: Callable[[], list[str]]) -> bool:
        """Whether the new signature ``key`` may be traced (``cached``: the traced ones;
        ``paths()``: the call's leaf paths, built only for a message). ``False``: run it
        eagerly. Raises :class:`JitRecompileLimitError` past the limit under ``"raise"``."""
        if not cached:
            return True
        limit, source = resolve_limit(self._limit)
        if len(cached) < limit:
            if not self._warned_first:
                self._warned_first = True
                warnings.warn(
                    self._first_message(key, cached, paths(), limit, source), JitRecompileWarning, stacklevel=4
                )
            return True
        what = "; ".join(changes(key, cached, paths(), labeler(self._f)))
        if self._on_limit == "raise":
            raise JitRecompileLimitError(
                f"fs.jit({self._name}): recompile limit reached: {len(cached)} signatures traced and compiled, "
                f"the limit is {limit} ({source}), and this call needs another: {what}. Pass changing numbers as "
                f"tensors, raise the limit (fs.jit(..., recompile_limit=N) or {ENV}=N), or run new signatures "
                f"eagerly (fs.jit(..., on_recompile_limit='eager'))."
            )
        if not self._warned_eager:
            self._warned_eager = True
            warnings.warn(
                f"fs.jit({self._name}): recompile limit {limit} ({source}) reached; this call and every "
                f"new signature from now on run eagerly, uncompiled (on_recompile_limit='eager'); the "
                f"{len(cached)} traced signatures stay compiled. This call: {what}.",
                JitRecompileWarning,
                stacklevel=4,
            )
        return False

    def _first_message(self, key, cached, paths, limit, source) -> str:
        what = "; ".join(changes(key, cached, paths, labeler(self._f)))
        after = "raises" if self._on_limit == "raise" else "runs new signatures eagerly"
        return (
            f"fs.jit({self._name}) compiles again (signature {len(cached) + 1}, limit {limit}: {source}): "
            f"{what}. Past {limit} signatures it {after} (on_recompile_limit={self._on_limit!r}). "
            f"This warning is given once per function."
        )
