"""Stock calls of a vlpack-built model equal the stock model: a left-padded batch with a 2-D
attention mask, and `generate` (KV cache, growing mask) through vlpack's text attention.

transformers passes `attention_mask=None` to a registered attention function without a mask
function; the base model's seam hands the 2-D mask on (attention.StockMask). The reference is the
same weights built by transformers with `attn_implementation="sdpa"`.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from vlpack.families import FAMILIES
from vlpack.model import build_model
from vlpack.model.forward import stock_visuals
from vlpack.model.synthetic import default_mix

FAMILIES_TESTED = ["qwen2_vl", "qwen3_vl", "qwen3_5"]  # plain, deepstack, Gated-DeltaNet


@pytest.fixture(scope="module", params=FAMILIES_TESTED)
def pair(request):
    import transformers

    model, spec = build_model(f"tiny-{request.param}", device="cpu", dtype=torch.float32)
    stock = getattr(transformers, FAMILIES[request.param].hf_class)._from_config(
        copy.deepcopy(model.config), attn_implementation="sdpa", dtype=torch.float32)
    stock.load_state_dict(model.state_dict())
    model.eval(), stock.eval()
    assert model.config.text_config._attn_implementation == "vlpack_varlen"
    return model, stock, spec


def left_padded(spec):
    """Two samples, left-padded to one length: two images, and text only (shorter)."""
    samples = default_mix(spec, 2, seed=5)
    L = max(len(s) for s in samples)
    ids = torch.full((2, L), spec.pad_token_id, dtype=torch.long)
    types = torch.zeros((2, L), dtype=torch.int32)
    mask = torch.zeros((2, L), dtype=torch.long)
    for b, s in enumerate(samples):
        n = len(s)
        ids[b, L - n:] = torch.as_tensor(s.input_ids)
        types[b, L - n:] = torch.as_tensor(s.mm_token_type_ids.astype(np.int32))
        mask[b, L - n:] = 1
    assert mask[1].sum() < L, "the text-only sample must be padded"
    visuals = stock_visuals(spec, **samples[0].hf_visuals())
    return dict(input_ids=ids, attention_mask=mask, mm_token_type_ids=types, **visuals)


def test_left_padded_forward_equals_stock(pair):
    model, stock, spec = pair
    inputs = left_padded(spec)
    with torch.no_grad():
        ours = model(**inputs, use_cache=False).logits
        want = stock(**inputs, use_cache=False).logits
    real = inputs["attention_mask"].bool()
    assert (ours - want)[real].abs().max() <= 1e-5


def test_generate_equals_stock(pair):
    model, stock, spec = pair
    inputs = left_padded(spec)
    kw = dict(max_new_tokens=3, min_new_tokens=3, do_sample=False, use_cache=True, output_logits=True,
              return_dict_in_generate=True, pad_token_id=spec.pad_token_id)
    with torch.no_grad():
        ours = model.generate(**inputs, **kw)
        want = stock.generate(**inputs, **kw)
    assert torch.equal(ours.sequences, want.sequences)
    assert len(ours.logits) == 3
    for a, b in zip(ours.logits, want.logits, strict=True):
        assert (a - b).abs().max() <= 1e-5


def test_cache_continuation_without_a_mask_equals_stock(pair):
    """A prompt fed in two chunks through the cache, no 2-D mask: the second chunk's queries
    see the cached keys (causal from the end of the keys), as stock."""
    model, stock, spec = pair
    ids = torch.as_tensor(default_mix(spec, 2, seed=5)[1].input_ids)[None]
    outs = []
    with torch.no_grad():
        for m in (model, stock):
            m.model.rope_deltas = None  # cached by an earlier call of another batch size
            first = m(input_ids=ids[:, :7], use_cache=True)
            outs.append(m(input_ids=ids[:, 7:], past_key_values=first.past_key_values,
                          use_cache=True).logits)
    assert outs[0].shape[1] == ids.shape[1] - 7 > 1
    assert (outs[0] - outs[1]).abs().max() <= 1e-5


def test_mask_shorter_than_the_queries_is_refused():
    from vlpack.model.attention import stock_attention

    q = k = v = torch.zeros(1, 2, 5, 4)
    with pytest.raises(ValueError, match="attention mask covers 4 tokens"):
        stock_attention(torch.nn.Module(), q, k, v, torch.ones(1, 4), 0.5)
