"""Whole compiled layers with the vision attention traced (`compile_layers(...,
trace_vision_attention=True)`): one set of graphs for every row, the kernel call the only break."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

from tests.helpers import CPU, losses, small_cfg
from vlpack.data.batch import build_thd_batch
from vlpack.model.build import build_model
from vlpack.model.compile import compile_layers
from vlpack.model.forward import packed_forward
from vlpack.model.synthetic import default_mix
from vlpack.train.trainer import Trainer


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
        batch = build_thd_batch(default_mix(spec, n, seed=n), pad_token_id=spec.pad_token_id,
                pad_to_multiple_of=1, mrope_after_video="transformers")
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


def test_sizes_equal_by_chance_do_not_recompile():
    """A first row of 3 segments has `cu_seq_lens` of 4, as many as its MRoPE position rows:
    with torch's duck shaping the layers' graphs guarded on that equality and compiled again
    for the next row. Each size is its own symbol (compile.py)."""
    torch._dynamo.reset()
    counters.clear()
    model, spec = build_model("tiny-qwen3_vl", device="cpu", seed=0)
    compile_layers(model)
    graphs = []
    for n in (3, 5, 6):
        batch = build_thd_batch(default_mix(spec, n, seed=n), pad_token_id=spec.pad_token_id,
                                pad_to_multiple_of=1, mrope_after_video="transformers")
        if n == 3:
            assert batch.position_ids.shape[0] == len(batch.cu_seqlens) == 4
        packed_forward(model, batch, spec=spec).loss_sum.backward()
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] > 0 and graphs[1:] == [graphs[0]] * 2, graphs


def test_layer_variants_past_dynamos_default_limit_stay_compiled(tmp_path: Path) -> None:
    """A LoRA run of the hybrid MoE family with half of each stack recomputed and an evaluation
    between steps compiles more variants of a layer's code than dynamo's default limit of 8
    (transformers' checkpointing wrapper is one code object for every layer class; recomputed or
    not, an input needing a gradient or not, training or evaluation): none of them falls back to
    eager (compile.py's `RECOMPILE_LIMIT`)."""
    from vlpack.train.distributed.parallel import shutdown

    torch._dynamo.reset()
    counters.clear()
    try:
        Trainer(small_cfg(tmp_path, "train.max_steps=3", "train.eval_every=2", "data.eval_samples=4",
                          "model.name=tiny-qwen3_5_moe", "model.lora.rank=4",
                          "model.activation_checkpointing=true", "model.checkpoint_share=0.5",
                          "model.compile=true", "model.compile_scope=layers"), CPU).fit()
    finally:
        shutdown()
    assert counters["stats"]["unique_graphs"] > 8
    limits = [k for k in counters["unimplemented"] if "recompile limit" in k.lower()]
    assert not limits, limits[0].splitlines()[0]
    assert counters["frames"]["ok"] == counters["frames"]["total"]  # every frame compiled


# --- model.compile through the trainer ---------------------------------------------------------------
@pytest.mark.parametrize("name,fsdp,scope", [
    ("tiny-qwen3_vl", "auto", "regions"), ("tiny-qwen3_5_moe", "auto", "regions"),
    ("tiny-qwen3_vl", "always", "regions"), ("tiny-qwen3_vl", "always", "layers"),
    ("tiny-qwen3_5_moe", "auto", "layers")])
def test_compiled_model_gives_the_same_losses(tmp_path: Path, name: str, fsdp: str,
                                               scope: str) -> None:
    """`model.compile=true` trains to the eager run's losses. `regions` (inductor-fused norms,
    MLPs and rotary functions): the hybrid MoE family covers its offset RMSNorm and shared-expert
    MLP, fsdp=always the compiled modules inside FSDP2-sharded blocks. `layers` (decoder layers
    and vision blocks whole): the attention call is a graph break, Gated-DeltaNet and routed
    experts stay eager, and nothing else breaks the graphs."""
    import inspect

    from torch._dynamo.utils import counters

    from vlpack.model.compile import compile_regions
    from vlpack.model.recompute import layer_stacks
    from vlpack.model.seams import classes_of
    from vlpack.model.vision import VisionAttention
    from vlpack.train.distributed.parallel import shutdown

    plain = Trainer(small_cfg(tmp_path / "a", "train.max_steps=3", f"model.name={name}"), CPU)
    plain.fit()
    modeling = inspect.getmodule(type(plain.model))
    stock = modeling.apply_rotary_pos_emb_vision
    torch._dynamo.reset()  # compile afresh: graphs cached by earlier tests would count nothing
    counters.clear()
    try:
        fused = Trainer(small_cfg(tmp_path / "b", "train.max_steps=3", f"model.name={name}",
                                  "model.compile=true", f"model.compile_scope={scope}",
                                  f"train.fsdp={fsdp}"), CPU)
        if scope == "regions":
            units = [m for m in fused.model.modules()
                     if type(m).__name__.endswith(("RMSNorm", "LayerNorm"))]
            assert {type(m).__name__ for m in units} >= {"LayerNorm"}  # the vision blocks' norms
        else:
            units = [layer for stack in layer_stacks(fused.model).values() for layer in stack]
            assert len(units) > 2
        assert all(getattr(m, "_compiled_call_impl", None) is not None for m in units)
        attn = [m for m in fused.model.modules() if isinstance(m, VisionAttention)]
        assert attn and all(m.vlpack_rotary is not stock for m in attn)  # compiled, ...
        fused.fit()
    finally:
        shutdown()
    assert modeling.apply_rotary_pos_emb_vision is stock  # ... and transformers' left alone
    assert counters["stats"]["unique_graphs"] > 0
    if scope == "layers":  # every graph break is one of the eager islands, by design
        breaks = {k.split("Developer debug context: ")[1].split()[1] for k in counters["graph_break"]}
        eager = {"varlen_attention_forward", "VisionAttention.forward",
                 "GatedDeltaNet.forward"}  # vlpack's seams
        islands = tuple(f"{c.__name__}.forward" for c in classes_of(fused.model).eager)
        assert breaks and all(b in eager or b.endswith(islands) for b in breaks), breaks
    a, b = losses(tmp_path / "a"), losses(tmp_path / "b")
    assert len(a) == 3 and max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-4, (a, b)
    with pytest.raises(ValueError, match=r"config\.model_type"):
        compile_regions(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_layers_scope_compiles_the_norms_and_mlps_inside_eager_modules() -> None:
    """`compile_layers` keeps the MoE block and Gated-DeltaNet eager, and compiles as regions the
    norms and MLPs they hold (the shared expert, the gated norm), which no compiled layer traces;
    modules a compiled layer traces are not compiled a second time."""
    from vlpack.model.recompute import layer_stacks
    from vlpack.model.seams import classes_of

    model, _ = build_model("tiny-qwen3_5_moe", device="cpu")
    compile_layers(model)
    cls = classes_of(model)
    islands = [m for m in model.modules() if isinstance(m, cls.eager)]
    kinds = {type(m).__name__ for m in islands}
    assert any(k.endswith("SparseMoeBlock") for k in kinds), kinds
    assert any(k.endswith("GatedDeltaNet") for k in kinds), kinds
    assert all(getattr(m.forward, "_vlpack_eager", False) for m in islands)
    held = [sub for m in islands for sub in m.modules() if isinstance(sub, cls.compiled)]
    assert {type(m).__name__ for m in held} == {"Qwen3_5MoeMLP", "Qwen3_5MoeRMSNormGated"}
    assert all(getattr(m, "_compiled_call_impl", None) is not None for m in held)
    in_island = {id(sub) for m in islands for sub in m.modules()}
    traced = [m for stack in layer_stacks(model).values() for layer in stack
              for m in layer.modules()
              if id(m) not in in_island and m is not layer and isinstance(m, cls.compiled)]
    assert traced and all(getattr(m, "_compiled_call_impl", None) is None for m in traced)
