"""Training parity: the pure-function Transformer with fs.optim.adamw trains like the
nn.Module twin with torch.optim.AdamW.

Both start from the same weights (``TransformerModule(cfg, seed)`` holds
``transformer_init(cfg, seed)``), see the same seeded batch at every step and run in
float64, so any difference beyond rounding is a bug in the model, in
``fs.value_and_grad`` or in the optimizer, not noise.
"""

import pytest
import torch
import torch.nn.functional as F

import fshard as fs
from fshard import nn as fnn
from fshard.models import TransformerConfig, TransformerModule, transformer_apply, transformer_init
from fshard.testing import assert_close

F64 = torch.float64
STEPS = 20
TOL = 1e-10
# Large enough lr that 20 steps move the loss well away from its start (a parity test
# that the loss never changes would pass for an optimizer that does nothing).
HP = dict(lr=1e-2, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)


def _batch(step: int, cfg: TransformerConfig, batch: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token data for ``step``: its own seed, so both loops see the same tokens.

    Each row counts up by a random stride from a random start (mod V): learnable, so the
    loss falls and the test also shows that the run trains.
    """
    g = torch.Generator().manual_seed(10_000 + step)
    start = torch.randint(0, cfg.vocab_size, (batch, 1), generator=g)
    stride = torch.randint(1, 4, (batch, 1), generator=g)
    tokens = (start + stride * torch.arange(cfg.max_seq_len + 1)) % cfg.vocab_size  # (B, T + 1)
    return tokens[:, :-1], tokens[:, 1:]


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _train_fshard(cfg: TransformerConfig, seed: int) -> tuple[list[float], dict]:
    params = transformer_init(cfg, seed, dtype=F64)
    opt = fs.optim.adamw(**HP)
    state = opt.init(params)
    loss_and_grads = fs.value_and_grad(lambda p, x, y: _loss(transformer_apply(p, x, cfg), y))
    losses = []
    for step in range(STEPS):
        tokens, targets = _batch(step, cfg)
        loss, grads = loss_and_grads(params, tokens, targets)
        updates, state = opt.update(grads, state, params)
        params = fs.optim.apply_updates(params, updates)
        losses.append(loss.item())
    return losses, params


def _train_module(cfg: TransformerConfig, seed: int) -> tuple[list[float], torch.nn.Module]:
    module = TransformerModule(cfg, seed, dtype=F64)
    opt = torch.optim.AdamW(module.parameters(), lr=HP["lr"], betas=(HP["b1"], HP["b2"]),
                            eps=HP["eps"], weight_decay=HP["weight_decay"], foreach=True)
    losses = []
    for step in range(STEPS):
        tokens, targets = _batch(step, cfg)
        opt.zero_grad(set_to_none=True)
        loss = _loss(module(tokens), targets)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, module


@pytest.mark.parametrize("tie_weights", [False, True])
def test_twenty_steps_match_module_with_torch_adamw(tie_weights):
    cfg = TransformerConfig(vocab_size=37, dim=24, n_layers=2, n_heads=4, max_seq_len=12,
                            tie_weights=tie_weights)
    fs_losses, fs_params = _train_fshard(cfg, seed=3)
    torch_losses, module = _train_module(cfg, seed=3)

    for step, (got, want) in enumerate(zip(fs_losses, torch_losses)):
        assert abs(got - want) <= TOL * max(1.0, abs(want)), f"step {step}: fshard {got!r} vs torch {want!r}"
    assert fs_losses[-1] < 0.75 * fs_losses[0], fs_losses  # it trained
    # The parameters too, so a difference that the loss happens to hide still fails.
    module_params = {n: p.detach() for n, p in module.named_parameters()}  # a tied weight appears once
    assert_close(fnn.to_state_dict(fs_params), module_params, rtol=TOL, atol=TOL, what="param")
    assert ("output.weight" in module_params) is not tie_weights
