"""Trainer switches: freezing, activation checkpointing, token-budget accumulation, recipes, plot."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import CPU, losses, small_cfg
from vlpack.cli import main
from vlpack.config import RECIPES, load_config
from vlpack.model.presets import PRESETS
from vlpack.train.loop import Trainer
from vlpack.train.module import module_groups


def test_freeze_vision_and_merger_keeps_them_fixed(tmp_path: Path) -> None:
    t = Trainer(small_cfg(tmp_path, "train.max_steps=2", "model.freeze_vision=true",
                          "model.freeze_merger=true"), CPU)
    groups = module_groups(t.model)
    before = {g: [p.detach().clone() for p in ps] for g, ps in groups.items()}
    t.fit()
    for g in ("vision", "merger"):
        assert all(torch.equal(a, p) for a, p in zip(before[g], groups[g], strict=True)), g
    assert any(not torch.equal(a, p) for a, p in zip(before["llm"], groups["llm"], strict=True))


def test_activation_checkpointing_gives_the_same_losses(tmp_path: Path) -> None:
    plain = Trainer(small_cfg(tmp_path / "a", "train.max_steps=2"), CPU).fit()
    ckpt = Trainer(small_cfg(tmp_path / "b", "train.max_steps=2",
                             "model.activation_checkpointing=true"), CPU).fit()
    assert abs(plain["last_loss"] - ckpt["last_loss"]) < 1e-5


def test_detect_anomaly_runs_the_step_in_anomaly_mode(tmp_path: Path) -> None:
    """`train.detect_anomaly=true` turns autograd's anomaly mode on for the step only."""
    t = Trainer(small_cfg(tmp_path, "train.max_steps=1", "train.detect_anomaly=true"), CPU)
    seen = []
    t.model.model.language_model.norm.register_forward_hook(
        lambda *_: seen.append(torch.is_anomaly_enabled()))
    t.fit()
    assert seen and all(seen) and not torch.is_anomaly_enabled()


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
    from vlpack.train.parallel import shutdown

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


def test_profile_writes_a_summary(tmp_path: Path) -> None:
    """`train.profile_steps`: a table of the profiled step, set against the unprofiled ones."""
    Trainer(small_cfg(tmp_path, "train.max_steps=3", "train.profile_steps=1",
                      "train.profile_from=3"), CPU).fit()
    text = (tmp_path / "profile_rank0.txt").read_text()
    assert text.startswith("1 steps, profiled wall") and "operators only" in text
    assert "operators:" in text and "aten::" in text
    with pytest.raises(ValueError, match=r"lower train\.profile_from"):
        small_cfg(tmp_path, "train.max_steps=3", "train.profile_steps=2", "train.profile_from=3")


def test_profile_stacks_add_host_time_by_call_site(tmp_path: Path) -> None:
    from vlpack.train.profile import StepProfiler

    prof = StepProfiler(tmp_path / "p.txt", start=1, count=1, device=torch.device("cpu"), stacks=True)
    prof.before(1)
    x = torch.randn(64, 64)
    for _ in range(3):
        x = torch.tanh(x @ x)
    prof.after(1)
    text = (tmp_path / "p.txt").read_text()
    assert "host time by call site" in text and "test_train_options.py" in text
    # the sites themselves, not only Python function events among the operators
    assert "Source Location" in text.split("host time by call site")[1]


def test_token_budget_accumulates_micro_batches(tmp_path: Path) -> None:
    t = Trainer(small_cfg(tmp_path, "train.max_steps=1", "train.tokens_per_step=1200"), CPU)
    mbs = t._next_micro_batches(iter(t.train_loader))
    assert sum(b.num_real_tokens for b in mbs) >= 1200 > sum(b.num_real_tokens for b in mbs[:-1])


@pytest.mark.parametrize("path", sorted(RECIPES.glob("*.yaml")), ids=lambda p: p.stem)
def test_recipes_name_known_presets(path: Path) -> None:
    assert load_config(path).model.name in PRESETS


def test_plot_overlays_runs(tmp_path: Path) -> None:
    for name in ("packed", "nopack"):
        packing = "bfd" if name == "packed" else "none"
        Trainer(small_cfg(tmp_path / name, "train.max_steps=2", f"data.packing={packing}"), CPU).fit()
    out = tmp_path / "overlay.png"
    assert main(["plot", str(tmp_path / "packed"), str(tmp_path / "nopack"), "--out", str(out)]) == 0
    assert out.stat().st_size > 1000
    panels = tmp_path / "panels.png"
    assert main(["plot", str(tmp_path / "packed"), str(tmp_path / "nopack"), "--out", str(panels),
                 "--metrics", "loss,grad_norm", "--x", "step"]) == 0
    from PIL import Image

    # two panels stacked: taller than the one-panel figure at the same width
    assert Image.open(panels).size[1] > Image.open(out).size[1] * 1.5
    assert main(["plot", str(tmp_path / "missing")]) == 2
    # a dense model records no aux loss: refused with the metrics it does record
    assert main(["plot", str(tmp_path / "packed"), "--metrics", "aux_loss"]) == 2


def test_pad_to_seq_len_gives_static_rows_and_the_same_loss(tmp_path: Path) -> None:
    a = Trainer(small_cfg(tmp_path / "a", "train.max_steps=1"), CPU)
    b = Trainer(small_cfg(tmp_path / "b", "train.max_steps=1", "data.pad_to_seq_len=true"), CPU)
    rows = [next(iter(t.train_loader)) for t in (a, b)]
    assert rows[1].num_tokens == 512 and rows[0].num_tokens < 512
    assert rows[0].sample_keys == rows[1].sample_keys
    assert abs(a.fit()["last_loss"] - b.fit()["last_loss"]) < 1e-5


def test_fsdp_root_keeps_its_parameters_for_backward(tmp_path: Path, monkeypatch) -> None:
    """FSDP2 re-gathers a module for backward from hooks on the tensors its forward returns. Up
    to torch 2.11 it finds them with pytree, which does not enter the root's `ForwardOut`
    dataclass: no hook. A root resharded after forward then read freed parameters in backward
    (a segfault on CPU, an illegal memory access on an H200: the 8B recipe on 2 GPUs). With that
    registration patched in, the root's parameters must still be gathered after forward, and
    the run must equal the plain one."""
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
    from torch.distributed.tensor import DTensor
    from torch.utils._pytree import tree_flatten

    from vlpack.train.parallel import shutdown

    def pytree_hooks(self, output):  # torch <= 2.11's registration
        if torch.is_grad_enabled():
            for t in tree_flatten(output)[0]:
                if torch.is_tensor(t) and t.requires_grad:
                    t.register_hook(self._pre_backward)
        return output

    monkeypatch.setattr(FSDPState, "_register_pre_backward_hook", pytree_hooks)
    try:
        plain = Trainer(small_cfg(tmp_path / "plain", "train.max_steps=2"), CPU)
        plain.fit()
        t = Trainer(small_cfg(tmp_path / "fsdp", "train.max_steps=2", "train.fsdp=always",
                              "train.reshard_after_forward=true"), CPU)
        root_params = [t.model.lm_head.weight, t.model.model.language_model.norm.weight]
        seen = []

        def after_forward(module, args, out):  # runs after FSDP2's own post-forward hook
            for name in ("lm_head", "model.language_model.norm"):
                w = t.model.get_submodule(name).weight
                # fails here, before a backward that would read freed memory and crash
                assert not isinstance(w, DTensor) and w.untyped_storage().nbytes() > 0, \
                    f"the root resharded {name} after forward: its backward reads freed memory"
            seen.append(True)

        t.module.register_forward_hook(after_forward)
        assert all(isinstance(p, DTensor) for p in root_params)  # sharded before any forward
        t.fit()
        assert len(seen) == 2
        assert max(abs(a - b) for a, b in zip(losses(tmp_path / "plain"),
                                               losses(tmp_path / "fsdp"), strict=True)) < 1e-5
    finally:
        shutdown()


def test_sharded_run_builds_shapes_then_receives_rank0s_weights(tmp_path: Path,
                                                                monkeypatch) -> None:
    """An FSDP2 run builds the model on the meta device, shards it, and only then receives
    rank 0's whole CPU copy (no rank holds the whole model on its accelerator): every
    parameter and buffer (rotary tables included) equals a plain build with the run's seed."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    import vlpack.model.build as build
    from vlpack.train.parallel import shutdown

    devices, original = [], build.build_model

    def record(*args, **kwargs):
        devices.append(torch.device(kwargs["device"]).type)
        return original(*args, **kwargs)

    monkeypatch.setattr(build, "build_model", record)
    try:
        t = Trainer(small_cfg(tmp_path, "train.max_steps=1", "train.fsdp=always"), CPU)
        assert devices == ["meta", "cpu"]
        got = get_model_state_dict(t.model, options=StateDictOptions(full_state_dict=True))
        want, _ = original(t.cfg.model.name, dtype=torch.float32, device="cpu",
                           seed=t.cfg.train.seed)
        assert set(got) == set(want.state_dict())
        for name, value in want.state_dict().items():
            assert torch.equal(got[name], value), name
        buffers = dict(t.model.named_buffers())
        for name, value in want.named_buffers():
            assert torch.equal(buffers[name], value), name
    finally:
        shutdown()


def test_fsdp_on_one_process_equals_plain_and_resumes(tmp_path: Path) -> None:
    """`train.fsdp=always` on one process (a one-rank group): the same losses as the plain run;
    its sharded checkpoint resumes to the straight run's losses."""
    from vlpack.train import checkpoint as ckpt
    from vlpack.train.parallel import shutdown

    try:
        plain = Trainer(small_cfg(tmp_path / "plain", "train.max_steps=4"), CPU)
        plain.fit()
        fsdp = Trainer(small_cfg(tmp_path / "fsdp", "train.max_steps=4", "train.fsdp=always"), CPU)
        assert torch.distributed.is_initialized()
        assert type(fsdp.model.model.language_model.layers[0]).__name__.startswith("FSDP")
        fsdp.fit()
        a, b = losses(tmp_path / "plain"), losses(tmp_path / "fsdp")
        assert len(a) == 4 and max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-5, (a, b)

        kept = Trainer(small_cfg(tmp_path / "kept", "train.max_steps=4", "train.fsdp=always",
                                 "train.reshard_after_forward=false"), CPU)
        kept.fit()  # parameters kept gathered from forward to backward: the same arithmetic
        assert losses(tmp_path / "kept") == b
        bf16 = Trainer(small_cfg(tmp_path / "bf16", "train.max_steps=1", "train.fsdp=always",
                                 "train.reduce_dtype=bfloat16"), CPU)
        block = bf16.model.model.language_model.layers[0]
        assert block._get_fsdp_state()._mp_policy.reduce_dtype == torch.bfloat16

        part = Trainer(small_cfg(tmp_path / "part", "train.max_steps=4", "train.fsdp=always",
                                 "train.stop_after=2"), CPU)
        part.fit()
        assert ckpt.latest_checkpoint(tmp_path / "part").name == "step_00000002"
        Trainer(small_cfg(tmp_path / "part", "train.max_steps=4", "train.fsdp=always"), CPU).fit()
        assert losses(tmp_path / "part") == b
    finally:
        shutdown()
