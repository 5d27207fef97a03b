"""Pitfalls peers shipped (shared/PEERS.md) that no other test names directly.
docs/pitfalls.md maps every pitfall to the test that covers it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.helpers import PAD, make_sample
from vlpack.data.batch import build_thd_batch
from vlpack.model import attention
from vlpack.model.build import build_model
from vlpack.model.forward import packed_forward


def test_packed_forward_uses_the_only_contract_stock_transformers_isolates() -> None:
    """Stock transformers keeps packed samples apart only with 4-row positions, no 2-D mask and
    no cache: packed_forward must always call the model that way, boundaries included."""
    model, spec = build_model("tiny-qwen3_vl", dtype=torch.float32, device="cpu", seed=0)
    rng = np.random.default_rng(0)
    batch = build_thd_batch([make_sample(f"s{i}", rng, patch_dim=spec.patch_dim) for i in range(3)],
                            pad_token_id=spec.pad_token_id, pad_to_multiple_of=8,
                                    mrope_after_video="transformers")
    seen = {}
    original = model.model.forward

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return original(*args, **kwargs)

    model.model.forward = spy
    packed_forward(model, batch, spec=spec)
    assert seen["position_ids"].shape == (4, 1, batch.num_tokens)
    assert seen.get("attention_mask") is None and seen["use_cache"] is False
    assert torch.equal(seen["cu_seq_lens_q"], batch.cu_seqlens_padded)
    assert seen["max_length_q"] == batch.max_seqlen


def test_boundaries_never_come_from_position_ids() -> None:
    """3-row MRoPE ids mistaken for packed data crashed a flash path (transformers #38007):
    vlpack's kernels ignore positions; without cu_seqlens a call is one sequence."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 12, 8) for _ in range(3))
    restarting = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3]])
    a, _ = attention.varlen_attention_forward(torch.nn.Module(), q, k, v, None,
                                              position_ids=restarting, is_causal=True)
    b, _ = attention.varlen_attention_forward(torch.nn.Module(), q, k, v, None, is_causal=True)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(a, want.transpose(1, 2))


def test_padding_mask_is_not_derived_from_token_ids() -> None:
    """`input_ids == 0` is not padding: id 0 ('!') is a real token."""
    rng = np.random.default_rng(0)
    s = make_sample("zeros", rng, text=(6,), grids=())
    s.input_ids[:] = 0
    b = build_thd_batch([s], pad_token_id=PAD, total_len=16,
            pad_to_multiple_of=1, mrope_after_video="transformers")
    assert not b.padding_mask[: len(s)].any() and b.padding_mask[len(s) :].all()
    assert b.num_real_tokens == len(s)


@pytest.mark.parametrize("mult", [1, 64])
def test_pad_to_multiple_pads_positions_too(mult: int) -> None:
    """LLaMA-Factory #10782: pad_to_multiple_of padded input ids but not position ids."""
    rng = np.random.default_rng(1)
    b = build_thd_batch([make_sample("a", rng), make_sample("b", rng)], pad_token_id=PAD,
                        pad_to_multiple_of=mult, mrope_after_video="transformers")
    assert b.position_ids.shape == (4, b.num_tokens) == (4, b.input_ids.shape[0])
    assert b.labels.shape == b.mm_token_type_ids.shape == b.padding_mask.shape == (b.num_tokens,)
