"""`vlpack export`: any checkpoint to a folder that transformers' own loaders serve with the
trained model's logits; bf16 by default with sharded safetensors and their index; a LoRA run's
frozen base rebuilt as the trainer built it; train.keep_checkpoints; the family chat templates."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import CPU, small_cfg
from vlpack.data.loader import open_dataset
from vlpack.train.run import checkpoint as ckpt
from vlpack.train.run.export import INDEX, export_checkpoint
from vlpack.train.trainer import Trainer


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 3-step run saved at every step, stopped after step 1 and resumed: (run folder, its
    trainer after step 1, after step 3)."""
    out = tmp_path_factory.mktemp("run")
    args = ("train.max_steps=3", "train.save_every=1", "train.keep_checkpoints=3")
    first = Trainer(small_cfg(out, *args, "train.stop_after=1"), CPU)
    first.fit()
    second = Trainer(small_cfg(out, *args), CPU)
    second.fit()
    return out, first, second


def _prompt(folder: Path):
    """transformers' processor built from `folder` (without torchvision: its image processor,
    tokenizer and chat template) and its inputs for a two-image conversation."""
    from vlpack.check.processor import _hf_inputs, build_processor

    proc, _, failed = build_processor(folder)
    assert failed is None, failed
    conv = open_dataset("synthetic", None, synthetic_samples=24)[0]
    return conv, _hf_inputs(proc, conv)


def _logits(model, inputs) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(**inputs).logits


def test_an_intermediate_checkpoint_serves_with_the_trained_logits(run, tmp_path: Path) -> None:
    """Step 1 of 3, exported in float32: AutoModelForImageTextToText and the folder's processor
    load it offline; the processor encodes the image prompt as training did, the logits equal
    those of the model after step 1, and greedy generation continues with its next token."""
    from transformers import AutoModelForImageTextToText

    out, first, second = run
    step_1 = out / "checkpoints" / "step_00000001"
    folder = export_checkpoint(step_1, tmp_path / "hf", out_dtype="float32")
    conv, inputs = _prompt(folder)
    trained = first.encoder.encode(conv)
    assert np.array_equal(inputs["input_ids"][0].numpy(), trained.input_ids)
    assert inputs["pixel_values"].shape[0] == int(trained.image_grid_thw.prod(-1).sum())
    model = AutoModelForImageTextToText.from_pretrained(folder, local_files_only=True)
    assert model.dtype == torch.float32
    got = _logits(model, inputs)
    assert (got - _logits(first.model, inputs)).abs().max() <= 1e-5
    assert (got - _logits(second.model, inputs)).abs().max() > 1e-4  # not the last checkpoint
    # greedy generation from the image prompt continues with the trained model's next token
    new = model.generate(**inputs, max_new_tokens=2, do_sample=False)
    assert new.shape[1] == inputs["input_ids"].shape[1] + 2
    assert int(new[0, inputs["input_ids"].shape[1]]) == int(_logits(first.model, inputs)[0, -1].argmax())


def test_the_default_export_is_bf16_sharded_with_its_index(run, tmp_path: Path) -> None:
    """`vlpack export RUN`: the latest checkpoint (step 3) in bf16 (config.json says so), every tensor in
    exactly one shard that the index names, the weights the trained ones rounded to bf16."""
    from transformers import AutoModelForImageTextToText

    from vlpack.cli import main

    out, _, second = run
    assert main(["export", str(out), "--out", str(tmp_path / "hf"),
                 "--max-shard-size", "4MB"]) == 0  # several shards of a tiny model
    folder = tmp_path / "hf"
    config = json.loads((folder / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and config["architectures"] == [
        "Qwen3VLForConditionalGeneration"]
    index = json.loads((folder / INDEX).read_text())["weight_map"]
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    assert len(shards) > 1 and sorted(set(index.values())) == shards
    stored = {k: (name, v) for name in shards for k, v in load_file(folder / name).items()}
    assert {k: name for k, (name, _) in stored.items()} == index
    assert all(v.dtype == torch.bfloat16 for _, v in stored.values())
    for name in ("chat_template.jinja", "tokenizer.json", "preprocessor_config.json",
                 "video_preprocessor_config.json", "generation_config.json"):
        assert (folder / name).is_file(), name
    from vlpack.data.encode import Encoder

    served = Encoder("qwen3_vl", processor_path=str(folder))  # the run's image and video settings
    assert (served.min_pixels, served.max_pixels, served.video) == (
        second.encoder.min_pixels, second.encoder.max_pixels, second.encoder.video)
    model = AutoModelForImageTextToText.from_pretrained(folder, local_files_only=True,
                                                        dtype=torch.float32)
    for n, p in second.model.named_parameters():
        assert torch.equal(model.get_parameter(n), p.detach().to(torch.bfloat16).float()), n
    # exported again into the same folder: no shard of the first export is left behind
    assert main(["export", str(out), "--out", str(tmp_path / "hf")]) == 0
    assert [p.name for p in folder.glob("*.safetensors")] == ["model-00001-of-00001.safetensors"]


@pytest.fixture
def umask_022():
    """The process umask 022 for the test (a serving container's usual one)."""
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_every_exported_file_has_the_umask_mode(run, tmp_path: Path, umask_022) -> None:
    """safetensors writes its files 0600; the export leaves every file it writes at the umask's
    mode (0644 under umask 022), so a serving container running as another user reads them."""
    folder = export_checkpoint(run[0], tmp_path / "hf", max_shard_bytes=4 * 10**6)
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in folder.iterdir()}
    assert len([n for n in modes if n.endswith(".safetensors")]) > 1
    assert {n: m for n, m in modes.items() if m != "0o644"} == {}


def test_keep_checkpoints_is_the_configured_number(run) -> None:
    """train.keep_checkpoints=3 keeps all three saves (the default, 2, rotates step 1 away)."""
    out, _, _ = run
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == [
        "step_00000001", "step_00000002", "step_00000003"]


def test_a_lora_export_rebuilds_the_frozen_base_as_the_trainer_held_it(tmp_path: Path) -> None:
    """A LoRA run whose base is held in bf16 (model.dtype=bfloat16: drawn in bf16) checkpoints
    only the adapters; the merged export equals the trained model's merged weights exactly and
    the adapter export holds the trained adapters in peft's names."""
    peft = pytest.importorskip("peft")
    from vlpack.model import lora

    t = Trainer(small_cfg(tmp_path / "run", "train.max_steps=2", "model.lora.rank=4",
                          "model.lora.alpha=8", "optim.lr=1e-2", "model.dtype=bfloat16"), CPU)
    t.fit()
    saved = ckpt.latest_checkpoint(tmp_path / "run")
    assert ckpt.marker(saved)["device"] == "cpu"
    folder = export_checkpoint(tmp_path / "run", tmp_path / "hf", out_dtype="float32")
    got = {k: v for p in folder.glob("*.safetensors") for k, v in load_file(p).items()}
    sd = {k: v.detach() for k, v in t.model.state_dict().items()}
    want = lora.merged_state_dict(t.model, sd)
    want.pop("lm_head.weight")  # tied to the embedding
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert torch.equal(got[k], v.float()), k
    umask = os.umask(0o022)
    os.umask(umask)
    adapter = export_checkpoint(saved, tmp_path / "adapter", mode="adapter")
    config = peft.LoraConfig.from_pretrained(str(adapter))
    assert config.r == 4 and config.base_model_name_or_path == "tiny-qwen3_vl"
    assert oct((adapter / "adapter_model.safetensors").stat().st_mode & 0o777) == oct(
        0o666 & ~umask)  # the umask's mode, not safetensors' 0600
    tensors = load_file(adapter / "adapter_model.safetensors")
    trained = {k: v for k, v in sd.items() if "lora_" in k}
    assert len(tensors) == len(trained)
    for k, v in trained.items():
        assert torch.equal(tensors[f"base_model.model.{k.replace('.default', '')}"], v), k


def test_bad_sources_are_named(tmp_path: Path, run) -> None:
    with pytest.raises(ValueError, match=r"neither a run folder .* nor a checkpoint folder"):
        export_checkpoint(tmp_path)
    with pytest.raises(ValueError, match=r"without LoRA .* --hf"):
        export_checkpoint(run[0], tmp_path / "a", mode="adapter")


@pytest.mark.parametrize("name", ["tiny-qwen2_vl", "tiny-qwen3_5_moe"])
def test_published_tensor_names_load_back(name: str, tmp_path: Path) -> None:
    """Families whose published checkpoints name or lay out tensors unlike transformers' modules
    (Qwen2-VL's `model.layers`, Qwen3.5-MoE's per-expert weights) are written in the published
    form, shard by shard (an experts tensor split in its own shard), and load back equal."""
    from transformers import AutoModelForImageTextToText

    from vlpack.model.build import build_model
    from vlpack.train.run.export import live_fetch, write_config, write_weights

    model, _ = build_model(name, dtype=torch.float32, device="cpu", seed=0)
    write_weights(model, tmp_path, live_fetch(model), dtype=torch.float32, max_shard_bytes=50_000)
    write_config(model, tmp_path, torch.float32)
    names = set(json.loads((tmp_path / INDEX).read_text())["weight_map"])
    if name == "tiny-qwen2_vl":
        assert "model.layers.0.mlp.down_proj.weight" in names
    else:
        assert "model.language_model.layers.0.mlp.experts.0.down_proj.weight" in names
    loaded = AutoModelForImageTextToText.from_pretrained(tmp_path, local_files_only=True)
    for n, p in model.named_parameters():
        assert torch.equal(loaded.get_parameter(n), p), n


def test_a_frozen_part_is_rebuilt_and_the_rest_read_from_the_checkpoint(tmp_path: Path) -> None:
    """model.freeze_vision: the checkpoint holds the LLM and merger, the export draws the vision
    tower again; every exported tensor equals the trained model's."""
    t = Trainer(small_cfg(tmp_path / "run", "train.max_steps=1", "model.freeze_vision=true"), CPU)
    t.fit()
    folder = export_checkpoint(tmp_path / "run", tmp_path / "hf", out_dtype="float32")
    got = {k: v for p in folder.glob("*.safetensors") for k, v in load_file(p).items()}
    want = {k: v for k, v in t.model.state_dict().items() if k != "lm_head.weight"}
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], v) for k, v in want.items())
