"""Shared pieces of :func:`fsdp_apply` and :func:`tp_apply`: finding the module behind an
``apply``, module path patterns, and hooks that exist only during one call.

Both wrappers reach into a functionalized module's forward through ``nn.Module`` forward
pre/post hooks registered when the wrapped function is called and removed when it
returns (or raises), so the user's module carries nothing between calls. Inside a call
they rebind a submodule's tensors the way ``torch.func.functional_call`` binds the whole
module's (``NamedMemberAccessor``), and put back what was there before the submodule's
forward ends; ``functional_call`` restores the module's own tensors at the end anyway.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Iterable

import torch
from torch import nn
from torch.nn.utils._named_member_accessor import NamedMemberAccessor

__all__ = ["module_of", "compile_pattern", "CallHooks", "swap"]


def module_of(apply: Any, what: str) -> nn.Module:
    """The ``nn.Module`` that ``apply`` (from ``fs.nn.functionalize``, maybe wrapped by
    ``tp_apply``/``fsdp_apply``) runs.

    Raises:
      TypeError: ``apply`` has no module (not from ``functionalize``).
    """
    module = getattr(apply, "module", None)
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"{what}: expected the apply function from fs.nn.functionalize(module) (or one wrapped by "
            f"fs.parallel.tp_apply / fsdp_apply), got {type(apply).__name__}, which has no .module."
        )
    return module


def aliases_of(module: nn.Module) -> dict[str, list[str]]:
    """Tied parameters: canonical name (``functionalize``'s) -> the other names of the tensor."""
    from fshard.nn import _tied_aliases

    return _tied_aliases(module)


def compile_pattern(pattern: str) -> re.Pattern:
    """A module path pattern: dotted names, ``*`` matching within one name
    (``model.layers.*.mlp`` matches ``model.layers.0.mlp``, not ``model.layers.0.x.mlp``)."""
    return re.compile(re.escape(pattern).replace(r"\*", r"[^.]*"))


def is_pattern(path: str) -> bool:
    return "*" in path


def module_paths(module: nn.Module) -> dict[str, nn.Module]:
    """Every submodule by dotted path (the root is ``""``), each module object once."""
    return dict(module.named_modules())


def nearest_names(module: nn.Module, path: str) -> str:
    """Where ``path`` stops resolving, and what exists there (for error messages)."""
    node = module
    done: list[str] = []
    for part in path.split("."):
        child = node._modules.get(part)
        if child is None:
            here = ".".join(done) or "<root>"
            kids = ", ".join(node._modules) or "none"
            return f"'{here}' ({type(node).__name__}) has no child '{part}'; its children: {kids}"
        node, done = child, done + [part]
    return ""


def swap(module: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rebinds ``module``'s tensors by dotted name; returns what was bound before."""
    orig, _ = NamedMemberAccessor(module).swap_tensors_dict(tensors, allow_missing=False)
    return orig


class CallHooks:
    """Forward pre/post hooks for one call; ``close()`` removes them all and runs the
    cleanups of hooks whose post hook never ran (the forward raised)."""

    def __init__(self) -> None:
        self._handles: list[Any] = []
        self._cleanups: list[Callable[[], None]] = []

    def add(self, module: nn.Module, pre: Callable | None, post: Callable | None) -> None:
        if pre is not None:
            self._handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        if post is not None:
            self._handles.append(module.register_forward_hook(post, with_kwargs=True))

    def push_cleanup(self, fn: Callable[[], None]) -> None:
        self._cleanups.append(fn)

    def pop_cleanup(self, fn: Callable[[], None]) -> None:
        """Runs ``fn`` now (the post hook's own cleanup) and forgets it."""
        for k in range(len(self._cleanups) - 1, -1, -1):
            if self._cleanups[k] is fn:
                del self._cleanups[k]
                break
        fn()

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        cleanups, self._cleanups = self._cleanups, []
        for fn in reversed(cleanups):
            fn()


def first_match_order(names: Iterable[str], compiled: list[tuple[str, re.Pattern]]) -> dict[str, str]:
    """``name -> pattern`` for the first pattern that fully matches each name."""
    out: dict[str, str] = {}
    for n in names:
        for pat, rx in compiled:
            if rx.fullmatch(n):
                out[n] = pat
                break
    return out
