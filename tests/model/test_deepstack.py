"""The indexed deepstack merge equals transformers' boolean-mask merge bitwise (values and
gradients), takes its positions from the forward's Boundaries, and is off outside vlpack's
forward."""

from __future__ import annotations

import pytest
import torch

from vlpack.data.batch import build_thd_batch
from vlpack.model import deepstack
from vlpack.model.build import build_model
from vlpack.model.forward import packed_forward
from vlpack.model.synthetic import default_mix


def _text_model():
    model, spec = build_model("tiny-qwen3_vl", dtype=torch.float32, device="cpu", seed=0)
    return model, spec, model.model.language_model


def _merge(lm, hidden, mask, embeds, *, indexed: bool):
    h = hidden.clone().requires_grad_()
    e = embeds.clone().requires_grad_()
    if indexed:
        index = deepstack._Index(torch.nonzero(mask.reshape(-1)).squeeze(1))
        out = lm._deepstack_process(h, index, e)
    else:
        out = type(lm)._vlpack_stock._deepstack_process(lm, h, mask, e)  # transformers' own
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return out.detach(), h.grad, e.grad


@pytest.mark.parametrize("rows", [1, 3])
def test_indexed_merge_is_bitwise_the_stock_merge(rows):
    _, _, lm = _text_model()
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(rows, 50, 64, generator=g)
    mask = torch.zeros(rows, 50, dtype=torch.bool)
    mask[0, 3:11] = True
    mask[-1, 30:42] = True
    embeds = torch.randn(int(mask.sum()), 64, generator=g)
    want = _merge(lm, hidden, mask, embeds, indexed=False)
    got = _merge(lm, hidden, mask, embeds, indexed=True)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_every_deepstack_layer_merges_by_the_forwards_index_and_stock_outside(monkeypatch):
    model, spec, lm = _text_model()
    calls = []
    original = type(lm)._deepstack_process

    def spy(self, hidden, mask, embeds):
        calls.append(mask)
        return original(self, hidden, mask, embeds)

    monkeypatch.setattr(type(lm), "_deepstack_process", spy)
    batch = build_thd_batch(default_mix(spec, 4), pad_token_id=spec.pad_token_id,
            pad_to_multiple_of=1, mrope_after_video="transformers")
    out = packed_forward(model, batch, spec=spec)
    depth = len(model.config.vision_config.deepstack_visual_indexes)
    assert len(calls) == depth >= 2  # every deepstack layer merged by index ...
    assert all(isinstance(m, deepstack._Index) and m is calls[0] for m in calls)  # ... one of it
    assert calls[0].index_N.tolist() == list(batch.image_positions)
    assert torch.isfinite(out.loss_sum)
    calls.clear()
    hidden = torch.zeros(1, 4, lm.config.hidden_size)
    lm._deepstack_process(hidden, torch.tensor([[True, False, True, False]]),
                          torch.ones(2, lm.config.hidden_size))
    assert len(calls) == 1 and not isinstance(calls[0], deepstack._Index)  # a mask: stock merge
