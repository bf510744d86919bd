"""One verdict per program: ``agree``, ``label`` (a docs/jax.md row) or ``mismatch`` (a kind).

The rule, in order:
  1. fshard's ranks disagree on a global result (a replicated out_spec whose value differs
     between ranks, or one rank raising): a mismatch, unless only gradients disagree in an
     unchecked program with a replicated differentiated input (that row says so).
  2. Both raise: agreement (the refusal may come at another moment, e.g. pmax's gradient).
  3. Only JAX raises: the pmax/pmin row (JAX refuses any pmax/pmin in differentiated code),
     the all_to_all quirk row, the pvary-of-varying row; the replication-promise row when
     JAX's unchecked twin equals fshard; else a mismatch (``jax refuses, fshard accepts``).
  4. Only fshard raises: a mismatch (``fshard refuses, jax accepts``).
  5. Both return: equal to 1e-12 agrees; differing gradients only, unchecked, with a row's
     feature: that row; else a mismatch (``values differ`` / ``gradients differ``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from conf_compare import leaf_mismatches

from . import labels


@dataclass(frozen=True)
class Verdict:
    kind: str  # "agree", "label", "mismatch"
    what: str = ""  # the row (label) or the mismatch kind
    detail: str = ""

    @property
    def key(self) -> str:
        return f"{self.kind}:{self.what}" if self.what else self.kind


def _grad_only(prog: dict, problems: list[str]) -> bool:
    """Only gradients differ (with grad of grad, the value is a gradient's norm too)."""
    ok = ("grads", "value") if prog["grad"]["mode"].startswith("nested") else ("grads",)
    return bool(problems) and all(p.startswith(ok) for p in problems)


def _disagreeing_leaves(fs_rec: dict) -> list[str]:
    """The leaf paths on which some rank differs from rank 0 (empty: a status differs)."""
    per_rank = fs_rec.get("per_rank") or []
    if not per_rank or any(v is None for v in per_rank):
        return []
    return sorted({p.split(":")[0] for v in per_rank[1:] for p in leaf_mismatches(v, per_rank[0])})


def classify(prog: dict, jax_rec: dict, fs_rec: dict) -> Verdict:
    """The verdict on one program (see the module doc for the rule)."""
    if fs_rec.get("ranks_disagree"):
        if labels.unchecked_row(prog) and labels.replicated_wrt(prog) and _grad_only(prog, _disagreeing_leaves(fs_rec)):
            return Verdict("label", labels.REPLICATED_INPUTS)
        return Verdict("mismatch", "ranks disagree", fs_rec["ranks_disagree"][:1500])
    j_err, f_err = jax_rec["status"] == "error", fs_rec["status"] == "error"
    if j_err and f_err:
        return Verdict("agree")
    if j_err:
        return _only_jax_raises(prog, jax_rec, fs_rec)
    if f_err:
        return Verdict("mismatch", f"fshard refuses ({short(fs_rec['error'])}), jax accepts", fs_rec["error"][:1500])
    problems = leaf_mismatches(fs_rec["value"], jax_rec["value"])
    if not problems:
        return Verdict("agree")
    row = labels.unchecked_row(prog)
    if row and _grad_only(prog, problems):
        return Verdict("label", row)
    what = "gradients differ" if _grad_only(prog, problems) else "values differ"
    return Verdict("mismatch", what, "\n".join(problems)[:1500])


def _only_jax_raises(prog: dict, jax_rec: dict, fs_rec: dict) -> Verdict:
    err = jax_rec["error"]
    quirk = labels.dead_pmax(prog, err) or labels.a2a_quirk(prog, err) or labels.pvary_of_varying(prog, err)
    if quirk:
        return Verdict("label", quirk)
    twin = jax_rec.get("twin")
    if prog["check"] and (labels.is_promise_refusal(err) or labels.promise_unproven(prog)) and twin is not None:
        if twin["status"] == "ok" and not leaf_mismatches(fs_rec["value"], twin["value"]):
            return Verdict("label", labels.PROMISE)
        why = twin.get("error") or "\n".join(leaf_mismatches(fs_rec["value"], twin["value"]))
        return Verdict("mismatch", "promise: fshard differs from jax's unchecked twin", why[:1500])
    return Verdict("mismatch", f"jax refuses ({short(err)}), fshard accepts", f"JAX: {err[:1200]}")


def short(err: str) -> str:
    """An error's kind for grouping: its type and first words, numbers and shapes dropped."""
    return re.sub(r"[\d\[\]{}]+", "", err.split("\n")[0])[:70].strip()
