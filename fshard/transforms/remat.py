"""``remat``: recompute a function's activations in backward instead of storing them.

On top of ``torch.utils.checkpoint`` (non-reentrant). Policies decide which op
outputs are saved anyway, through torch's selective checkpointing:

- ``None`` / ``"nothing_saveable"``: save nothing; everything, collectives included,
  is recomputed in backward (so the collectives run again: ``comm_log`` counts them).
- ``"save_collectives"``: save the outputs of collectives, recompute the rest, so
  backward issues no extra communication.
- ``"dots_saveable"``: save matmul outputs (and collectives), recompute elementwise ops.
- a callable ``(op) -> bool``: ``True`` saves that ATen op's output.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from fshard import lax
from fshard.transforms.grad import depth as grad_depth
from fshard.transforms.grad import reset_depth, set_depth
from fshard.transforms.vma import VmaMode

__all__ = ["checkpoint_policies", "remat"]

# The collectives themselves, not ``wait_tensor``: a saved collective's output is replayed
# already complete, and waiting on it again is a no-op. Saving waits would also record waits
# on collectives started outside the region (a prefetched gather that the next collective on
# its gloo group completes first: comm.one_at_a_time), which the recomputation never
# replays, and selective checkpointing would hand their results to the wrong op.
_COLLECTIVE_OPS = {
    torch.ops._c10d_functional.all_reduce.default,
    torch.ops._c10d_functional.all_gather_into_tensor.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops._c10d_functional.all_to_all_single.default,
}
_DOT_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.baddbmm.default,
    torch.ops.aten.linear.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}

checkpoint_policies: dict[str, Callable[[Any], bool] | None] = {
    "nothing_saveable": None,
    "save_collectives": lambda op: op in _COLLECTIVE_OPS,
    "dots_saveable": lambda op: op in _DOT_OPS or op in _COLLECTIVE_OPS,
}


def resolve_policy(policy: str | Callable[[Any], bool] | None) -> Callable[[Any], bool] | None:
    """The ``op -> bool`` function a policy name stands for (``None``: save nothing).

    Raises:
      ValueError: an unknown policy name (the known ones are listed).
    """
    if isinstance(policy, str):
        if policy not in checkpoint_policies:
            raise ValueError(
                f"remat: unknown policy {policy!r}; choose one of {sorted(checkpoint_policies)} or pass op -> bool."
            )
        return checkpoint_policies[policy]
    return policy


def saves_gathers(policy: str | Callable[[Any], bool] | None) -> bool:
    """Whether ``policy`` saves an all-gather's result (so backward must not regather)."""
    policy = resolve_policy(policy)
    return policy is not None and bool(
        policy(torch.ops._c10d_functional.all_gather_into_tensor.default)
        or policy(torch.ops._c10d_functional.wait_tensor.default)
    )


def remat(f: Callable[..., Any], policy: str | Callable[[Any], bool] | None = None) -> Callable[..., Any]:
    """Wraps ``f`` so that its intermediate activations are recomputed in backward.

    Args:
      f: any function of tensors (a block, a shard_map body, a whole loss).
      policy: see the module doc; a name from ``checkpoint_policies`` or ``op -> bool``.

    Returns:
      A function with ``f``'s signature and results.

    Inside nested ``fs.grad`` calls (grad of grad, Hessian-vector products) the
    recomputation replays the grad nesting too, so higher-order gradients are JAX's.
    Under ``torch.func``'s ``grad``/``vjp``/``jacrev``/``hessian`` (e.g. ``jvp`` of
    ``fs.grad``: forward-over-reverse), where torch's checkpoint cannot run (saved-tensor
    hooks are disabled there), ``f`` runs as is: the same values, activations stored.
    Under an ``fs.grad`` that keeps its graph (the inner one of grad of grad), a policy
    that saves some ops is dropped for that call and everything is recomputed: torch's
    selective checkpointing allows one backward through a region.

    Raises:
      ValueError: an unknown policy name (the known ones are listed).
    """
    policy = resolve_policy(policy)

    def _sac_policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if policy(op) else CheckpointPolicy.PREFER_RECOMPUTE

    @functools.wraps(f)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if not torch._C._autograd._saved_tensors_hooks_is_enabled():  # type: ignore[attr-defined]
            return f(*args, **kwargs)  # torch.func's grad transforms: checkpoint would raise
        # The recomputation runs during backward, outside the shard_map body and outside
        # the fs.grad calls that enclosed the first run: carry the body (mesh, checked mode)
        # and that grad depth into it, so that collectives, implicit pvary and a nested
        # fs.grad (which keeps its graph only when enclosed) replay alike.
        body, depth = lax.BODY.get(), grad_depth()

        def replayable(*a: Any, **k: Any) -> Any:
            token, depth_token = lax.BODY.set(body), set_depth(depth)
            try:
                if body is not None and body.check:
                    with VmaMode():
                        return f(*a, **k)
                return f(*a, **k)
            finally:
                reset_depth(depth_token)
                lax.BODY.reset(token)

        if policy is None or depth[1]:
            # Under an fs.grad that keeps its graph (grad of grad), the region's backward is
            # itself differentiated, which torch's selective checkpointing refuses ("only
            # allowed to backward once"): recompute everything instead (the same values).
            return checkpoint(replayable, *args, use_reentrant=False, **kwargs)
        return checkpoint(
            replayable,
            *args,
            use_reentrant=False,
            context_fn=functools.partial(create_selective_checkpoint_contexts, _sac_policy),
            **kwargs,
        )

    return wrapped
