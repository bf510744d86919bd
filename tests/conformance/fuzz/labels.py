"""The labelling rules: outcomes that differ from JAX by design, each tied to a docs/jax.md row.

A rule is a row name (the "topic" column of docs/jax.md, verbatim), the outcome it may
explain, and a predicate on the program. The rules are the whole list: anything else that
differs is a mismatch.

- ``Replication promised by out_specs (checked mode)``: JAX refused a checked program
  statically for an out_spec its types do not prove, fshard ran it (the values were
  identical), and fshard's values and gradients equal JAX's unchecked twin's.
- The six ``Unchecked mode: ...`` rows: an unchecked program whose values agree with JAX
  but whose gradients do not (or whose ranks disagree on gradients only), and which has
  the feature the row is about (first matching row wins).
- ``pmax / pmin gradients``: JAX refused to differentiate a pmax/pmin whose result
  nothing uses (it linearizes dead code); fshard refuses only when backward reaches one.
- ``pvary of a value already varying over all of its axes``: JAX refuses it, fshard
  returns the value as it is.
- ``untiled all_to_all with split_axis != concat_axis, differentiated`` (docs/jax.md,
  "Where JAX 0.10.2 is not the oracle"): JAX fails to transpose it.
"""

from __future__ import annotations

PROMISE = "Replication promised by `out_specs` (checked mode)"
PMAX = "`pmax` / `pmin` gradients"
REPLICATED_INPUTS = "Unchecked mode: replicated inputs"
A2A_QUIRK = "untiled `all_to_all` with `split_axis != concat_axis`, differentiated"


def _ops(prog: dict) -> set[str]:
    return {op for _, op, _, _ in prog["ops"]}


def _size(prog: dict, axes) -> int:
    sizes = {a: s for a, s in prog["mesh"]}
    n = 1
    for a in ([axes] if isinstance(axes, str) else axes):
        n *= sizes[a]
    return n


def _omits_real_axis(prog: dict, spec: list) -> bool:
    """The spec leaves out a mesh axis of size > 1 (a replication promise over it)."""
    named = {a for e in spec if e for a in ([e] if isinstance(e, str) else e)}
    return any(s > 1 and a not in named for a, s in prog["mesh"])


def _grads_inside(prog: dict) -> bool:
    return prog["grad"]["mode"].endswith("inside")


def _has_psum_transpose(prog: dict) -> bool:
    return _grads_inside(prog) and (prog["grad"].get("loss") == "psum" or bool(_ops(prog) & {"psum", "pmean"}))


def replicated_wrt(prog: dict) -> bool:
    specs = {n: s for n, _, s in prog["inputs"]}
    return any(_omits_real_axis(prog, specs[w]) for w in prog["grad"].get("wrt", ()))


def _replicated_out(prog: dict) -> bool:
    return (not _grads_inside(prog)) and any(_omits_real_axis(prog, s) for _, s in prog["outputs"])


def splits_invariant_out(prog: dict) -> bool:
    """Gradients outside, and an out_spec names an axis (size > 1) that the output's checked
    type does not vary over: JAX sums the copies' gradients, unchecked fshard adds nothing."""
    if _grads_inside(prog):
        return False
    sizes, vma = {a: s for a, s in prog["mesh"]}, prog.get("out_vma", {})
    return any(sizes[a] > 1 and a not in vma.get(o, ())
               for o, spec in prog["outputs"] for e in spec if e for a in ([e] if isinstance(e, str) else e))


UNCHECKED_ROWS = (
    ("Unchecked mode: `psum`'s transpose", _has_psum_transpose),
    ("Unchecked mode: explicit `pvary`", lambda p: "pvary" in _ops(p)),
    (REPLICATED_INPUTS, replicated_wrt),
    ("Unchecked mode: replicated outputs", _replicated_out),
    ("Unchecked mode: an output spec that splits a value invariant over its axis", splits_invariant_out),
    ("Unchecked mode: an invariant value meets a varying one, no explicit `pvary`", lambda p: bool(p.get("meets"))),
)


def unchecked_row(prog: dict) -> str | None:
    """The unchecked-mode row that may explain differing gradients, or None."""
    if prog["check"] or prog["grad"]["mode"] == "none":
        return None
    return next((row for row, applies in UNCHECKED_ROWS if applies(prog)), None)


def live_vars(prog: dict) -> set[str]:
    """The variables the outputs depend on."""
    live = {o for o, _ in prog["outputs"]}
    for out, _, args, _ in reversed(prog["ops"]):
        if out in live:
            live |= {a for a in args if isinstance(a, str)}
    return live


def dead_pmax(prog: dict, jax_error: str) -> str | None:
    """JAX refuses to linearize any pmax/pmin inside differentiated code, even one that no
    gradient reaches (its result unused, or only compared: ``(pmax(x) > 0)``); fshard
    refuses when backward reaches one (which it then never does: this is called only when
    fshard accepted the program, and fshard's pmax/pmin raise in backward)."""
    if "Differentiation rule for 'pm" not in jax_error:
        return None
    return PMAX if any(op in ("pmax", "pmin") for _, op, _, _ in prog["ops"]) else None


PVARY_VARYING = "`pvary` of a value already varying over all of its axes (checked mode)"


def pvary_of_varying(prog: dict, jax_error: str) -> str | None:
    """JAX refuses ``pcast(to="varying")`` of a value already varying over the axes; fshard
    returns it as it is (a value varying over some of them only is refused by both)."""
    if prog["check"] and "Unsupported pcast from=varying" in jax_error and "pvary" in _ops(prog):
        return PVARY_VARYING
    return None


def a2a_quirk(prog: dict, jax_error: str) -> str | None:
    """JAX cannot transpose an untiled all_to_all with split_axis != concat_axis."""
    if prog["grad"]["mode"] == "none" or "Expected cotangent type" not in jax_error:
        return None
    if any(op == "all_to_all" and not a["tiled"] and a["split"] != a["concat"] for _, op, _, a in prog["ops"]):
        return A2A_QUIRK
    return None


def promise_unproven(prog: dict) -> bool:
    """A checked program with an output whose type (the generator's, JAX's rules) varies over
    a mesh axis that its out_spec leaves out: JAX refuses it statically, even for an axis of
    size 1 (on which fshard's run-time check trivially passes)."""
    if _grads_inside(prog):
        return False  # shard_map's outputs are the gradients, laid out like their inputs
    vma = prog.get("out_vma", {})
    for o, spec in prog["outputs"]:
        named = {a for e in spec if e for a in ([e] if isinstance(e, str) else e)}
        if any(a not in named for a in vma.get(o, ())):
            return True
    return False


def is_promise_refusal(err: str) -> bool:
    """JAX's static refusal of an out_spec that leaves out an axis the value varies over.
    JAX 0.10.2 sometimes fails while formatting that refusal (``_inout_vma_error`` on a
    multi-dim spec raises a pytree error): the same refusal."""
    return ("out_specs" in err and "replication" in err) or "broadcast_prefix prefix_tree" in err
