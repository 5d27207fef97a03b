"""Boundary-aware Gated-DeltaNet (model/gdn.py): the segment conv, the boundaries handed to fla,
and the seam that leaves transformers' own module untouched."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vlpack.model import build_model, gdn
from vlpack.model.bounds import Boundaries, Segments


def test_segment_conv_restarts_at_boundaries():
    x = torch.randn(1, 6, 20)
    w, b = torch.randn(6, 4), torch.randn(6)
    segs = Segments.from_host((0, 3, 11, 20), torch.device("cpu"))
    y = gdn.segment_conv1d(x, w, b, "silu", segs)
    for s, e in [(0, 3), (3, 11), (11, 20)]:
        ref = F.silu(F.conv1d(x[:, :, s:e], w[:, None], b, padding=3, groups=6)[:, :, : e - s])
        assert (y[:, :, s:e] - ref).abs().max() < 1e-6
    with pytest.raises(ValueError, match="cu_seqlens_padded"):
        gdn.segment_conv1d(x, w, b, "silu", Segments(torch.tensor([0, 5, 5, 20]), (0, 5, 5, 20), 15))


def test_fla_gets_one_boundary_tensor_pair_per_forward():
    """Every GDN layer of a forward hands fla the same cu_seqlens objects (fla caches its chunk
    indices by identity: new objects per layer would cost a host sync per layer); another
    forward's Boundaries get their own."""
    def fla_fn(x, cu_seqlens=None, cu_seqlens_cpu=None):
        return x

    segs = Segments.from_host((0, 5, 12), torch.device("cpu"))
    bounds = Boundaries(text=segs)
    first = gdn._fla_bounds(fla_fn, segs, bounds, "cpu")
    again = gdn._fla_bounds(fla_fn, segs, bounds, "cpu")
    assert first["cu_seqlens"] is again["cu_seqlens"]
    assert first["cu_seqlens_cpu"] is again["cu_seqlens_cpu"]
    assert first["cu_seqlens"].dtype == torch.long and first["cu_seqlens_cpu"].tolist() == [0, 5, 12]
    other = gdn._fla_bounds(fla_fn, segs, Boundaries(text=segs), "cpu")
    assert other["cu_seqlens"] is not first["cu_seqlens"]
    assert "cu_seqlens_cpu" not in gdn._fla_bounds(lambda x, cu_seqlens=None: x, segs, bounds, "cpu")
    assert gdn._fla_bounds(fla_fn, segs, bounds, "meta")["cu_seqlens"].device.type == "meta"


def test_fla_chunk_indices_are_built_on_the_host():
    """A packed row hands fla its chunk indices (fla's own copy of them to the device blocks):
    one (segment, chunk) pair per started chunk, none for an empty segment; the same tensor for
    every layer of the forward; none for boundaries that are not the row's."""
    def fla_fn(x, cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None):
        return x

    segs = Segments.from_host((0, 5, 12, 12, 13), torch.device("cpu"))
    bounds = Boundaries(text=segs)
    assert bounds.fla_chunks(torch.device("cpu"), 4).tolist() == [
        [0, 0], [0, 1], [1, 0], [1, 1], [3, 0]]
    assert bounds.fla_chunks(torch.device("cpu"), 64).tolist() == [[0, 0], [1, 0], [3, 0]]
    first = gdn._fla_bounds(fla_fn, segs, bounds, "cpu", 64)
    assert first["chunk_indices"].tolist() == [[0, 0], [1, 0], [3, 0]]
    assert gdn._fla_bounds(fla_fn, segs, bounds, "cpu", 64)["chunk_indices"] is first["chunk_indices"]
    assert first["chunk_indices"].dtype == torch.long
    # fla's chunk size unknown (fla absent, or its conv and delta rule disagree): fla builds them
    assert "chunk_indices" not in gdn._fla_bounds(fla_fn, segs, bounds, "cpu", None)
    chunks = Segments.from_host((0, 70), torch.device("cpu"))  # a context-parallel chunk's own
    assert "chunk_indices" not in gdn._fla_bounds(fla_fn, chunks, bounds, "cpu", 64)


def test_the_packed_delta_rule_hands_fla_the_host_boundaries(monkeypatch):
    """Where fla runs the delta rule, the call reaches fla's own function with the host copy of
    the boundaries and the chunk indices (what its signature takes), so fla never reads them
    back from the device; and `paths` names the call."""
    seen = {}

    def fla_gdr(q, k, v, g=None, beta=None, use_qk_l2norm_in_kernel=False, cu_seqlens=None,
                cu_seqlens_cpu=None, chunk_indices=None):
        seen.update(cu_seqlens_cpu=cu_seqlens_cpu, chunk_indices=chunk_indices)
        return v, None

    monkeypatch.setattr(gdn, "_use_fla", lambda x: True)
    monkeypatch.setattr(gdn, "_fla", lambda: (None, fla_gdr))
    monkeypatch.setattr(gdn, "_fla_chunk", lambda: 64)
    monkeypatch.setattr(gdn.fla_hopper, "dispatched_backend", lambda *a: None)
    segs = Segments.from_host((0, 5, 12), torch.device("cpu"))
    bounds = Boundaries(text=segs)
    x = torch.randn(1, 12, 2, 4)
    with torch.no_grad():
        out = gdn.segment_delta_rule(x, x, x, torch.zeros(1, 12, 2), torch.ones(1, 12, 2), segs,
                                     bounds, torch_fn=None)
    assert out is x and seen["cu_seqlens_cpu"].tolist() == [0, 5, 12]
    assert seen["chunk_indices"].tolist() == [[0, 0], [1, 0]]
    assert bounds.paths["gdn.delta_rule"] == "fla chunk_gated_delta_rule (cu_seqlens)"


def test_gdn_seam_leaves_transformers_untouched():
    """Building a packed Qwen3.5 changes the classes of its own GDN modules only: the modeling
    module's functions stay transformers' own, and a stock GDN module built afterwards keeps
    the stock class and forward."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    before = (m.causal_conv1d_fn, m.torch_chunk_gated_delta_rule, m.Qwen3_5GatedDeltaNet.forward)
    model, _ = build_model("tiny-qwen3_5", device="cpu")
    assert (m.causal_conv1d_fn, m.torch_chunk_gated_delta_rule,
            m.Qwen3_5GatedDeltaNet.forward) == before
    layers = [x for x in model.modules() if isinstance(x, m.Qwen3_5GatedDeltaNet)]
    assert layers and all(isinstance(x, gdn.GatedDeltaNet) for x in layers)
    stock = m.Qwen3_5GatedDeltaNet(model.config.text_config, 0)
    assert type(stock) is m.Qwen3_5GatedDeltaNet
