"""Whole compiled layers with the vision attention traced (`compile_layers(...,
trace_vision_attention=True)`): one set of graphs for every row, the kernel call the only break."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from vlpack.data.batch import build_thd_batch
from vlpack.model.build import build_model
from vlpack.model.compile import compile_layers
from vlpack.model.forward import packed_forward
from vlpack.model.synthetic import default_mix


def _break_names() -> set[str]:
    """The functions dynamo broke its graphs at (from the graph-break counter's keys)."""
    names = set()
    for key in counters["graph_break"]:
        context = key.split("Developer debug context: ")[-1]
        names.add(context.split()[1] if context.startswith("<function") else context)
    return names


@pytest.mark.parametrize("name", ["tiny-qwen3_vl", "tiny-qwen2_5_vl"])  # 2.5: window blocks
def test_traced_vision_attention_serves_every_row_without_recompiling(name):
    """Rows with other image counts, lengths and segment counts reuse the first row's graphs
    (a vision attention that let the tracer see the row's host boundaries recompiled every
    block for every row until dynamo's recompile limit sent every layer back to eager), the
    only breaks are the two attention kernels, and loss and gradients equal the eager model's.
    Qwen2.5-VL's blocks alternate between the full and the windowed segments."""
    torch._dynamo.reset()
    counters.clear()
    eager, spec = build_model(name, device="cpu", seed=0)
    fused, _ = build_model(name, device="cpu", seed=0)
    compile_layers(fused, trace_vision_attention=True)
    graphs = []
    for n in (4, 6, 7):
        batch = build_thd_batch(default_mix(spec, n, seed=n), pad_token_id=spec.pad_token_id)
        want, got = packed_forward(eager, batch, spec=spec), packed_forward(fused, batch, spec=spec)
        want.loss_sum.backward()
        got.loss_sum.backward()
        graphs.append(counters["stats"]["unique_graphs"])
        assert abs(float(got.loss_sum) - float(want.loss_sum)) <= 1e-5 * abs(float(want.loss_sum))
        reference = dict(eager.named_parameters())
        for name, p in fused.named_parameters():
            assert torch.allclose(p.grad, reference[name].grad, rtol=1e-4, atol=1e-5), name
        eager.zero_grad(set_to_none=True)
        fused.zero_grad(set_to_none=True)
    assert graphs[0] > 0 and graphs[1:] == [graphs[0]] * 2, graphs
    assert _break_names() == {"attend_row", "varlen_attention_forward"}, _break_names()
