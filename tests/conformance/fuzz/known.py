"""Known fshard bugs the fuzzer finds on main, each a small predicate over (program, verdict).

The CI test (``tests/conformance/test_fuzz.py``) lets a mismatch pass only when one of
these claims it, and fails when a listed bug no longer shows up in its seed set (fixed:
delete its entry). The goal is an empty list; every entry names the issue that tracks it.
"""

from __future__ import annotations

from .compare import Verdict


def _sizes(prog: dict) -> dict[str, int]:
    return {a: s for a, s in prog["mesh"]}


def _named(spec: list) -> set[str]:
    return {a for e in spec if e for a in ([e] if isinstance(e, str) else e)}


def _out_spec_names_invariant_axis(prog: dict, v: Verdict) -> bool:
    """grad(shard_map(f)) where an out_spec names a mesh axis (size > 1) the output does not
    vary over: JAX sums the cotangent's copies over that axis (the out_spec's implicit pvary
    transposes to psum), fshard does not. E.g. ``shard_map(lambda w: w * 2, in_specs=P(),
    out_specs=P("x"))`` on x=4: JAX's gradient 8, fshard's 2."""
    if v.what != "gradients differ" or not prog["check"] or prog["grad"]["mode"].endswith("inside"):
        return False
    sizes, vma = _sizes(prog), prog.get("out_vma", {})
    return any(sizes[a] > 1 and a not in vma.get(o, ()) for o, spec in prog["outputs"] for a in _named(spec))


def _pvary_of_varying(prog: dict, v: Verdict) -> bool:
    """``fs.lax.pvary(x, ax)`` with ``x`` already varying over ``ax``: JAX 0.10.2 refuses
    ("Unsupported pcast from=varying, to='varying'"), fshard returns ``x``."""
    return v.what.startswith("jax refuses (ValueError: Unsupported pcast from=varying")


def _pmax_size_one_axis(prog: dict, v: Verdict) -> bool:
    """The gradient of ``pmax``/``pmin`` over axes of size 1: JAX refuses (no
    differentiation rule, whatever the size), fshard's collective is the identity there and
    differentiates it (docs/jax.md's row says both refuse)."""
    if not v.what.startswith("jax refuses (NotImplementedError: Differentiation rule for 'pm"):
        return False
    sizes = _sizes(prog)
    axes = [a["axes"] for _, op, _, a in prog["ops"] if op in ("pmax", "pmin")]
    return bool(axes) and all(sizes[x] == 1 for ax in axes for x in ([ax] if isinstance(ax, str) else ax))


# name -> (issue, predicate)
KNOWN: dict[str, tuple[str, object]] = {
    "out_spec names an invariant axis: gradient not summed": ("issue 29", _out_spec_names_invariant_axis),
    "pvary of an already-varying value accepted": ("issue 29", _pvary_of_varying),
    "pmax/pmin over size-1 axes differentiable": ("issue 29", _pmax_size_one_axis),
}


def known_bug(prog: dict, v: Verdict) -> str | None:
    """The known bug that explains this mismatch, or None."""
    return next((name for name, (_, pred) in KNOWN.items() if pred(prog, v)), None)
