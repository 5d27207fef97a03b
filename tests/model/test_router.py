"""MoE router statistics take the experts each router chose (model/moe.py): the same counts and
loss as choosing them again from the logits, which the reference below does."""

from __future__ import annotations

import pytest
import torch

from vlpack.model.build import build_model
from vlpack.model.moe import RouterCapture, router_stats


def test_router_stats_take_the_routers_own_choice():
    model, spec = build_model("tiny-qwen3_5_moe", device="cpu", dtype=torch.float32, seed=0)
    ids = torch.randint(0, 1000, (1, 37))
    with torch.no_grad(), RouterCapture(model) as cap:
        model.model.language_model(input_ids=ids, use_cache=False)
    n_layers = model.config.text_config.num_hidden_layers
    assert len(cap.logits) == len(cap.indices) == n_layers
    for logits, chosen in zip(cap.logits, cap.indices, strict=True):
        want = torch.topk(torch.softmax(logits.float(), -1), spec.num_experts_per_tok, -1).indices
        assert torch.equal(chosen, want)
    real = torch.ones(37, dtype=torch.bool)
    real[-5:] = False  # padding is left out either way
    ours = router_stats(cap.logits, real, spec.num_experts, spec.num_experts_per_tok,
                        chosen=cap.indices)
    again = router_stats(cap.logits, real, spec.num_experts, spec.num_experts_per_tok)
    assert torch.equal(ours.tokens_per_expert, again.tokens_per_expert)
    assert torch.equal(ours.aux_loss, again.aux_loss) and int(ours.num_tokens) == 32
    with pytest.raises(ValueError, match="routers' choices"):
        router_stats(cap.logits, real, spec.num_experts, spec.num_experts_per_tok,
                     chosen=cap.indices[:-1])


def test_a_router_that_returns_only_logits_leaves_the_choice_to_the_stats(monkeypatch):
    """A router module whose output has no indices: `indices` is None, and `router_stats` takes
    the top-k itself."""
    from vlpack.model import moe

    router = torch.nn.Linear(4, 6)
    monkeypatch.setattr(moe, "routers", lambda model: [router])
    with RouterCapture(torch.nn.Identity()) as capture:
        router(torch.randn(3, 4))
    assert len(capture.logits) == 1 and capture.indices is None
