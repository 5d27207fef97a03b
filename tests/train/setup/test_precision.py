"""Frozen weights held in the compute dtype (train/setup/precision.py): which parameter gets which
dtype, in one process and under FSDP2, and that holding them in bf16 changes no result."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers import CPU, make_sample, run_ranks, small_cfg
from vlpack.config import LoraConfig
from vlpack.data.batch import build_thd_batch
from vlpack.model.build import build_model
from vlpack.train.setup import precision
from vlpack.train.setup.module import TrainModule
from vlpack.train.trainer import Trainer

peft = pytest.importorskip("peft")


def _dtypes(model: torch.nn.Module) -> dict[str, tuple[torch.dtype, bool]]:
    out = {}
    for n, p in model.named_parameters():
        t = p.to_local() if hasattr(p, "to_local") else p
        out[n] = (t.dtype, p.requires_grad)
    return out


LINEARS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
           "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj", "qkv", "proj",
           "linear_fc1", "linear_fc2", "shared_expert_gate"}
"""The linear layers of the tiny presets, by leaf name (the vision patch embedding's `proj` is
a Conv3d)."""


def _expect(name: str, trains: bool, sharded: bool = False) -> torch.dtype:
    """The rule, written out by name: a frozen linear, expert or router weight (the MoE block's
    `gate`, a plain weight that transformers applies with F.linear) and, on one device, a frozen
    input embedding (built in bf16 here) are bf16, all else fp32."""
    module = name.replace(".base_layer", "").rsplit(".", 1)[0]
    linear = module.rsplit(".", 1)[-1] in LINEARS and "patch_embed" not in module
    expert = module.endswith(".experts") or module.endswith(".mlp.gate")
    embedding = module.endswith("language_model.embed_tokens") and not sharded
    return torch.bfloat16 if not trains and (linear or expert or embedding) else torch.float32


def test_lora_base_is_bf16_and_adapters_float32(tmp_path: Path) -> None:
    """A LoRA run under bf16 autocast: the base's linear and expert weights and its input
    embedding (built in bf16, its lookup cast to float32) are bf16, the adapters float32
    masters, norms float32, and the tied lm_head stays the embedding; it trains."""
    t = Trainer(small_cfg(tmp_path, "model.name=tiny-qwen3_5_moe", "model.dtype=bfloat16",
                          "model.lora.rank=4", "train.max_steps=2"), CPU)
    got = _dtypes(t.model)
    for n, (dtype, trains) in got.items():
        assert trains == ("lora_" in n), n
        assert dtype == _expect(n, trains), (n, dtype)
    emb = t.model.get_input_embeddings()
    assert got["model.language_model.embed_tokens.weight"][0] == torch.bfloat16
    assert isinstance(emb, precision.HeldEmbedding)
    assert emb(torch.tensor([1, 2])).dtype == torch.float32
    assert t.model.lm_head.weight is emb.weight
    assert any(d == torch.bfloat16 and ".experts." in n for n, (d, _) in got.items())
    assert sum(d == torch.bfloat16 for d, _ in got.values()) > 20
    summary = t.fit()
    assert np.isfinite(summary["last_loss"])


def test_frozen_vision_is_bf16_and_the_training_llm_float32(tmp_path: Path) -> None:
    t = Trainer(small_cfg(tmp_path, "model.dtype=bfloat16", "model.freeze_vision=true",
                          "model.freeze_merger=true"), CPU)
    for n, (dtype, trains) in _dtypes(t.model).items():
        assert trains == (".visual." not in f".{n}"), n
        assert dtype == _expect(n, trains), (n, dtype)


def test_float32_setting_and_float32_runs_keep_everything_float32(tmp_path: Path) -> None:
    for extra in (("model.dtype=bfloat16", "model.frozen_dtype=float32"), ("model.dtype=float32",)):
        t = Trainer(small_cfg(tmp_path / extra[-1], "model.lora.rank=4", *extra), CPU)
        assert {d for d, _ in _dtypes(t.model).values()} == {torch.float32}, extra


@pytest.mark.parametrize(("name", "experts"), [("tiny-qwen3_vl", False),
                                               ("tiny-qwen3_5_moe", False),
                                               ("tiny-qwen3_5_moe", True)])
def test_holding_frozen_weights_in_bf16_changes_no_result(name: str, experts: bool) -> None:
    """Under bf16 autocast, a LoRA model whose frozen linear and expert weights are held in
    bf16 gives the float32-held model's loss and adapter gradients bit for bit (autocast casts
    those weights to bf16 at every use anyway): the memory saving is free. That holds with the
    routed experts adapted (`model.lora.experts`) too: their adapters reach vlpack's dispatch
    as factors, never folded into the weight (peft's parametrization would form W + B·A in W's
    dtype, rounding the update into a bf16-held weight). The model is built in bf16,
    as the training build is where weights are drawn at random or stored in bf16 (the released
    checkpoints), and the reference holds every parameter in float32; the held model keeps its
    frozen input embedding in bf16 as well, its lookup cast to float32."""
    model, spec = build_model(name, dtype=torch.bfloat16, device="cpu", seed=0)
    torch.manual_seed(1)
    from vlpack.model import lora

    lora.apply_lora(model, LoraConfig(rank=4, alpha=8, experts=experts))
    for n, p in model.named_parameters():  # nonzero B: the adapters take part in the forward
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.02)
    held = copy.deepcopy(model)
    assert precision.hold_parameters(model, None) == 0
    n_low = precision.hold_parameters(held, torch.bfloat16)
    assert n_low > 0
    assert isinstance(held.get_input_embeddings(), precision.HeldEmbedding)
    assert held.get_input_embeddings().weight.dtype == torch.bfloat16
    rng = np.random.default_rng(0)
    samples = [make_sample(f"s{i}", rng, text=(9, 13), grids=((1, 4, 4),), spec=spec,
                           patch_dim=spec.patch_dim) for i in range(3)]
    batch = build_thd_batch(samples, pad_token_id=spec.pad_token_id, pad_to_multiple_of=8,
            mrope_after_video="transformers")
    results = []
    for m in (model, held):
        module = TrainModule(m, spec, loss_method="chunked")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = module(batch)
        out.loss_sum.backward()
        grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.requires_grad}
        results.append((out.loss_sum.detach(), grads))
    (l32, g32), (l16, g16) = results
    assert g32.keys() == g16.keys() and len(g32) > 4
    assert torch.equal(l32, l16), (l32, l16)
    differ = [n for n in g32 if not torch.equal(g32[n], g16[n])]
    assert not differ, differ[:4]


def _fsdp_worker(rank: int, port: int, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    from vlpack.train.distributed.parallel import init_distributed, shutdown

    topo = init_distributed()
    try:
        t = Trainer(small_cfg(Path(out), "model.name=tiny-qwen3_5_moe", "model.dtype=bfloat16",
                              "model.lora.rank=4", "model.lora.experts=true",
                              "train.max_steps=1"), topo)
        got = _dtypes(t.model)
        bad = [(n, d) for n, (d, trains) in got.items() if d != _expect(n, trains, sharded=True)]
        assert not bad, bad[:4]
        assert any(hasattr(p, "to_local") for p in t.model.parameters())  # sharded
        t.fit()
    finally:
        shutdown()


def test_fsdp2_shards_of_frozen_weights_are_bf16(tmp_path: Path) -> None:
    """Two gloo ranks under FSDP2: each rank's shards of the frozen base (experts adapted by
    LoRA included) are bf16, the adapters' float32, and a step runs."""
    codes = run_ranks(_fsdp_worker, str(tmp_path), world=2, timeout=400)
    assert codes == [0, 0], codes


def test_a_checkpoint_holds_what_trains_and_resumes_exactly(tmp_path: Path) -> None:
    """A LoRA checkpoint holds the adapters and their optimizer state, not the frozen base
    (rebuilt from the same model.name and seed on resume); 2 + 2 resumed steps equal 4."""
    from torch.distributed.checkpoint import FileSystemReader

    args = ("model.dtype=bfloat16", "model.lora.rank=4", "optim.lr=1e-2", "optim.warmup_steps=0")
    straight = Trainer(small_cfg(tmp_path / "a", "train.max_steps=4", *args), CPU)
    straight.fit()
    part = Trainer(small_cfg(tmp_path / "b", "train.max_steps=4", "train.stop_after=2", *args), CPU)
    part.fit()
    keys = FileSystemReader(str(part.last_checkpoint)).read_metadata().state_dict_metadata
    params = [k for k in keys if k.startswith("model.") and k.endswith((".weight", ".bias"))]
    assert params and all("lora_" in k for k in params), params[:5]
    resumed = Trainer(small_cfg(tmp_path / "b", "train.max_steps=4", "train.resume=auto", *args), CPU)
    resumed.fit()
    from tests.helpers import losses

    assert losses(tmp_path / "a") == losses(tmp_path / "b")


def test_build_dtype_rounds_no_stored_weight(tmp_path: Path) -> None:
    """A folder is built in bf16 only when every stored tensor is bf16 (an fp16 or fp32 one
    would be rounded); random weights of a preset are drawn in bf16."""
    from safetensors.torch import save_file

    for dtype, want in ((torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32),
                        (torch.float32, torch.float32)):
        folder = tmp_path / str(dtype)
        folder.mkdir()
        save_file({"w": torch.zeros(2, dtype=dtype)}, str(folder / "model.safetensors"))
        assert precision.build_dtype(str(folder), torch.bfloat16) == want, dtype
        assert precision.build_dtype(str(folder), None) == torch.float32
    assert precision.build_dtype("tiny-qwen3_vl", torch.bfloat16) == torch.bfloat16


def test_resume_with_other_frozen_parameters_is_refused(tmp_path: Path) -> None:
    """A checkpoint holds what trains: resuming it with other parameters frozen would silently
    put the model's own weights back where trained ones were, so it is refused by name."""
    Trainer(small_cfg(tmp_path, "train.max_steps=1"), CPU).fit()
    again = Trainer(small_cfg(tmp_path, "train.max_steps=2", "model.freeze_vision=true"), CPU)
    with pytest.raises(ValueError, match=r"froze other parameters .*Resume with the run's own"):
        again.fit()


INT8 = ("model.name=tiny-qwen3_5_moe", "model.dtype=bfloat16", "model.lora.rank=4",
        "model.frozen_dtype=int8", "optim.lr=1e-2", "optim.warmup_steps=0")


def test_int8_runs_hold_the_experts_in_int8_resume_exactly_and_export_the_stored_base(
        tmp_path: Path) -> None:
    """`model.frozen_dtype=int8`: the routed experts' weights are int8 with float32 row scales,
    every other parameter follows the bf16 rule, and the memory plan counts them at a byte
    each; 2 + 2 resumed steps equal 4 (a resume quantizes the base again, bit for bit); the
    merged export writes the experts as the base stores them (bf16, not the int8 rounding)."""
    from tests.helpers import losses
    from vlpack.train.run import checkpoint as ckpt
    from vlpack.train.run.export import export_checkpoint

    straight = Trainer(small_cfg(tmp_path / "a", "train.max_steps=4", *INT8), CPU)
    got = _dtypes(straight.model)
    experts = {n for n in got if ".experts." in n}
    assert experts and all(got[n][0] == torch.int8 for n in experts)
    for n, (dtype, trains) in got.items():
        assert trains == ("lora_" in n), n
        if n not in experts:
            assert dtype == _expect(n, trains), (n, dtype)
    scales = {n: b for n, b in straight.model.named_buffers() if n.endswith("_proj_scale")}
    assert len(scales) == len(experts) and all(b.dtype == torch.float32 for b in scales.values())
    int8_bytes = sum(p.numel() for n, p in straight.model.named_parameters() if n in experts)
    assert straight.plan.weights["int8"] == int8_bytes
    straight.fit()
    part = Trainer(small_cfg(tmp_path / "b", "train.max_steps=4", "train.stop_after=2", *INT8), CPU)
    part.fit()
    resumed = Trainer(small_cfg(tmp_path / "b", "train.max_steps=4", "train.resume=auto", *INT8), CPU)
    resumed.fit()
    assert losses(tmp_path / "a") == losses(tmp_path / "b")
    assert all(np.isfinite(losses(tmp_path / "a")))

    folder = export_checkpoint(ckpt.latest_checkpoint(tmp_path / "a"), tmp_path / "hf",
                               out_dtype="bfloat16")
    from safetensors.torch import load_file

    exported = {k: v for p in folder.glob("*.safetensors") for k, v in load_file(p).items()}
    base, _ = build_model("tiny-qwen3_5_moe", device="cpu", dtype=torch.bfloat16,
                          seed=straight.cfg.train.seed, random_init=True)
    layers = [n.removesuffix(".gate_up_proj") for n, _ in base.named_parameters()
              if n.endswith("experts.gate_up_proj")]
    assert layers
    for name in layers:  # published per expert: gate and up rows of [gate; up], and down
        gate_up, down = base.get_parameter(f"{name}.gate_up_proj"), base.get_parameter(f"{name}.down_proj")
        inter = gate_up.shape[1] // 2
        for e in range(gate_up.shape[0]):
            assert torch.equal(exported[f"{name}.{e}.gate_proj.weight"], gate_up[e, :inter])
            assert torch.equal(exported[f"{name}.{e}.up_proj.weight"], gate_up[e, inter:])
            assert torch.equal(exported[f"{name}.{e}.down_proj.weight"], down[e])


def test_int8_settings_that_cannot_work_are_refused(tmp_path: Path) -> None:
    """int8 with the experts' own adapters, padded batches, the live HF export, on a dense
    model, or with the experts training: each a ValueError naming the fix, before any step."""
    from vlpack.config import load_config

    with pytest.raises(ValueError, match=r"model\.lora\.experts=false"):
        load_config("tiny", ["model.frozen_dtype=int8", "model.lora.rank=4",
                             "model.lora.experts=true"])
    with pytest.raises(ValueError, match=r"data\.packing=bfd"):
        load_config("tiny", ["model.frozen_dtype=int8", "data.packing=none"])
    with pytest.raises(ValueError, match=r"vlpack export RUN_DIR"):
        load_config("tiny", ["model.frozen_dtype=int8", "train.export_hf=true"])
    with pytest.raises(ValueError, match="no routed experts"):
        Trainer(small_cfg(tmp_path / "d", "model.name=tiny-qwen3_5", "model.lora.rank=4",
                          "model.frozen_dtype=int8"), CPU)
    with pytest.raises(ValueError, match="trains them"):
        Trainer(small_cfg(tmp_path / "f", "model.name=tiny-qwen3_5_moe",
                          "model.frozen_dtype=int8"), CPU)


def test_resume_with_another_frozen_dtype_is_refused(tmp_path: Path) -> None:
    """A checkpoint of an int8 run resumed with model.frozen_dtype=auto would train its adapters
    against another base: refused, naming the setting."""
    Trainer(small_cfg(tmp_path, "train.max_steps=2", "train.stop_after=1", *INT8), CPU).fit()
    auto = [k for k in INT8 if not k.startswith("model.frozen_dtype")]
    again = Trainer(small_cfg(tmp_path, "train.max_steps=2", "train.resume=auto", *auto), CPU)
    with pytest.raises(ValueError, match=r"other dtypes \(model\.frozen_dtype"):
        again.fit()


def test_a_held_embedding_leaves_the_frozen_dtypes_fingerprint_as_it_was() -> None:
    """A run checkpointed with its frozen input embedding in float32 resumes where it is held
    in bf16 (the same values, the same results); a frozen linear held otherwise still changes
    the fingerprint."""
    from vlpack.train.run.checkpoint import frozen_dtypes_fingerprint

    model, _ = build_model("tiny-qwen3_5_moe", dtype=torch.bfloat16, device="cpu", seed=0)
    for p in model.parameters():
        p.requires_grad_(False)
    before = copy.deepcopy(model)
    precision.hold_parameters(before, torch.bfloat16, embedding=False)
    assert before.get_input_embeddings().weight.dtype == torch.float32
    precision.hold_parameters(model, torch.bfloat16)
    assert model.get_input_embeddings().weight.dtype == torch.bfloat16
    assert frozen_dtypes_fingerprint(model) == frozen_dtypes_fingerprint(before)
    precision.hold_parameters(before, None)  # every frozen weight float32
    assert frozen_dtypes_fingerprint(model) != frozen_dtypes_fingerprint(before)
