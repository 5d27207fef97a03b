"""`vlpack check`'s inputs and command line: models of any vocabulary, config-only folders,
context parallelism beside data parallelism, and the user's data file."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from vlpack.cli import main

# transformers' own model-test configs (tests/models/<family>/test_modeling_<family>.py): vocab
# 99, bos 0, eos 1, pad 2, image 3, video 4, vision start 5, vision end 6; hidden 32, 2 layers.
TEXT = {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2, "hidden_act": "silu",
        "hidden_size": 32, "vocab_size": 99, "intermediate_size": 37,
        "max_position_embeddings": 512, "num_attention_heads": 4, "num_hidden_layers": 2,
        "num_key_value_heads": 2, "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000, "mrope_section": [2, 1, 1]}}
IDS = {"image_token_id": 3, "video_token_id": 4, "vision_start_token_id": 5,
       "vision_end_token_id": 6, "tie_word_embeddings": True}
ROPE3 = {"rope_type": "default", "rope_theta": 10000, "mrope_section": [2, 1, 1],
         "mrope_interleaved": True}
VISION3 = {"depth": 2, "hidden_act": "gelu_pytorch_tanh", "hidden_size": 32,
           "intermediate_size": 32, "out_hidden_size": 32, "num_heads": 4, "patch_size": 16,
           "spatial_merge_size": 1, "temporal_patch_size": 2, "num_position_embeddings": 16}
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16}
GDN = {"head_dim": 32, "layer_types": ["full_attention", "linear_attention"],
       "linear_conv_kernel_dim": 2, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
       "linear_num_key_heads": 4, "linear_num_value_heads": 8, "rope_parameters": ROPE3}
HF_TEST_CONFIGS = {
    "qwen2_vl": dict(text_config=TEXT, vision_config={
        "depth": 2, "embed_dim": 32, "hidden_act": "quick_gelu", "hidden_size": 32,
        "mlp_ratio": 4, "num_heads": 4, "patch_size": 14, "spatial_merge_size": 2,
        "temporal_patch_size": 2}),
    "qwen2_5_vl": dict(text_config=TEXT, vision_config={
        "depth": 2, "hidden_act": "silu", "hidden_size": 32, "intermediate_size": 32,
        "out_hidden_size": 32, "num_heads": 4, "patch_size": 14, "spatial_merge_size": 1,
        "temporal_patch_size": 2, "window_size": 112, "fullatt_block_indexes": [0],
        "tokens_per_second": 2}),
    "qwen3_vl": dict(text_config={**TEXT, "head_dim": 8, "rope_parameters": ROPE3},
                     vision_config={**VISION3, "deepstack_visual_indexes": [0, 1]}),
    "qwen3_vl_moe": dict(text_config={**TEXT, **MOE, "head_dim": 8, "rope_parameters": ROPE3,
                                      "decoder_sparse_step": 1, "mlp_only_layers": []},
                         vision_config={**VISION3, "deepstack_visual_indexes": [0, 1]}),
    "qwen3_5": dict(text_config={**TEXT, **GDN}, vision_config=VISION3),
    "qwen3_5_moe": dict(text_config={**TEXT, **GDN, **MOE, "shared_expert_intermediate_size": 16},
                        vision_config=VISION3),
}


def hf_test_folder(path, family: str, weights: bool = True):
    """A checkpoint folder of transformers' test config of `family` (random weights saved with
    save_pretrained, or config.json alone)."""
    import torch
    import transformers
    from transformers import CONFIG_MAPPING

    from vlpack.families import family as family_of

    config = CONFIG_MAPPING[family](**HF_TEST_CONFIGS[family], **IDS)
    if not weights:
        config.save_pretrained(path)
        return path
    torch.manual_seed(0)
    getattr(transformers, family_of(family).hf_class)(config).save_pretrained(path)
    return path


def _report(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.parametrize("family", list(HF_TEST_CONFIGS))
def test_check_passes_on_transformers_test_configs(tmp_path, capsys, family):
    """A vocabulary of 99 with special ids 0-6: the check's text ids stay inside it and away
    from the special ids, and packed equals unpacked."""
    folder = hf_test_folder(tmp_path / family, family)
    assert main(["check", "--model", str(folder), "--samples", "2", "--json"]) == 0
    r = _report(capsys)
    assert r["passed"] and r["family"] == family, r["failures"]


def test_synthetic_text_ids_fit_a_small_vocabulary():
    from vlpack.model.build import build_model
    from vlpack.model.synthetic import default_mix, text_id_range

    _, spec = build_model("tiny-qwen3_vl", device="meta")
    assert text_id_range(spec) == (0, 151643)  # below <|endoftext|>, the first special id
    small = spec.__class__(**{**spec.__dict__, "vocab_size": 99, "pad_token_id": 2,
                              "eos_token_id": 1, "image_token_id": 3, "video_token_id": 4,
                              "vision_start_token_id": 5, "vision_end_token_id": 6})
    assert text_id_range(small) == (7, 99)
    for s in default_mix(small, 4):
        text = s.input_ids[s.mm_token_type_ids == 0]
        assert set(text.tolist()) - set(range(7, 99)) <= {1, 5, 6}  # eos, vision start/end


def test_check_data_on_a_small_vocabulary(tmp_path, capsys):
    """`--data` on a model of 99 ids: the built-in tokenizer's ids are folded into its
    vocabulary (vision ids mapped to the model's), and packed equals unpacked."""
    from PIL import Image

    folder = hf_test_folder(tmp_path / "m", "qwen2_vl")
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (56, 84, 3), dtype=np.uint8)).save(
        tmp_path / "a.png")
    rows = [{"messages": [{"role": "user", "content": "Total?"},
                          {"role": "assistant", "content": "12.50"}]},
            {"messages": [{"role": "user", "content": [{"type": "image", "image": "a.png"},
                                                       {"type": "text", "text": "What?"}]},
                          {"role": "assistant", "content": "A receipt."}]}]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["check", "--model", str(folder), "--data", str(data), "--samples", "2",
                 "--json"]) == 0
    assert _report(capsys)["passed"]


def test_check_config_only_folder_names_init_random(tmp_path, capsys):
    """A folder with config.json alone: refused with a message that names the check's own
    `--init random` (not a training key); with it, random weights of its shape pass."""
    folder = hf_test_folder(tmp_path / "cfg", "qwen3_vl", weights=False)
    assert main(["check", "--model", str(folder), "--samples", "2"]) == 2
    err = capsys.readouterr().err
    assert "no weights" in err and "--init random" in err and "model.init" not in err
    assert main(["check", "--model", str(folder), "--samples", "2", "--init", "random",
                 "--json"]) == 0
    r = _report(capsys)
    assert r["passed"] and r["init"] == "random"


def test_init_random_reads_no_weights(tmp_path):
    """`random_init` on a folder that holds weights builds random ones of its config (seeded),
    not the saved ones."""
    import torch

    from vlpack.model.build import build_model

    folder = hf_test_folder(tmp_path / "w", "qwen3_vl")
    saved, _ = build_model(str(folder), device="cpu", dtype="float32")
    rand, _ = build_model(str(folder), device="cpu", dtype="float32", random_init=True, seed=1)
    again, _ = build_model(str(folder), device="cpu", dtype="float32", random_init=True, seed=1)
    name = "model.language_model.layers.0.mlp.gate_proj.weight"
    p = {n: dict(m.named_parameters())[name] for n, m in
         (("saved", saved), ("rand", rand), ("again", again))}
    assert not torch.equal(p["saved"], p["rand"]) and torch.equal(p["rand"], p["again"])


def _check_rank(rank: int, port: int, out: str, world: int) -> None:
    """One process of `vlpack check --cp 2` over `world` gloo ranks (torchrun's environment),
    run twice: as it is, then with the text attention's key/value gather planted to run over
    the world instead of the context group. Each rank writes both exit codes, rank 0 also both
    printed reports, to `out`.RANK."""
    import contextlib
    import io
    import os

    import torch
    import torch.distributed as dist

    from vlpack.model import context

    def over_world(ctx, x, group, rank, size):
        ctx.group, ctx.rank, ctx.size = group, rank, size
        x = x.contiguous()
        full = x.new_empty((dist.get_world_size() * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(full, x)  # no group: the world
        return full[: size * x.shape[0]]

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    results = []
    for plant in (False, True):
        if plant:
            context._GatherRows.forward = staticmethod(over_world)
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            rc = main(["check", "--model", "tiny-qwen3_vl", "--cp", "2", "--samples", "2",
                       "--json"])
        results.append(dict(rc=rc, report=printed.getvalue().strip()))
    Path(f"{out}.{rank}").write_text(json.dumps(results))


def test_check_cp_with_data_parallel_replicas(tmp_path):
    """`vlpack check --cp 2` on 4 processes: 2 data-parallel replicas × 2 context-parallel
    ranks, each replica its own row. It passes; with the keys and values gathered over the
    world instead of the context group, replica 1 reads replica 0's rows and the check fails
    (exit 1 on every rank), naming the replica."""
    from tests.helpers import run_ranks

    out = tmp_path / "ranks"
    assert run_ranks(_check_rank, str(out), 4, world=4, timeout=600) == [0] * 4
    ranks = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(4)]
    (clean, planted) = [json.loads(x["report"].splitlines()[-1]) for x in ranks[0]]
    for r in (clean, planted):
        assert [x["replica"] for x in r["replicas"]] == [0, 1] and r["cp"] == 2
        assert r["replicas"][0]["sample_keys"] == r["replicas"][1]["sample_keys"][::-1]
    assert [x[0]["rc"] for x in ranks] == [0] * 4 and clean["passed"], clean["failures"]
    assert [x[1]["rc"] for x in ranks] == [1] * 4 and not planted["passed"]
    assert planted["replicas"][0]["passed"] and not planted["replicas"][1]["passed"]
    assert all(f.startswith("replica 1: ") for f in planted["failures"]), planted["failures"]
    assert any("dlogits" in f for f in planted["failures"]), planted["failures"]
    print(planted["failures"])


GOOD_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is string %}"
    "{{ m.content }}{% else %}{% for c in m.content %}{% if c.type == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif c.type == 'video' %}"
    "<|vision_start|><|video_pad|><|vision_end|>{% else %}{{ c.text }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}")


def _processor_folder(path: Path, name: str) -> Path:
    """A checkpoint folder transformers builds a processor from: a tiny preset's config and
    weights, the offline tokenizer, the image processor's config and a chat template."""
    from vlpack.data.processor import load_image_processor
    from vlpack.data.tokenizer import load_tokenizer
    from vlpack.model.build import build_model

    model, _ = build_model(f"tiny-{name}", device="cpu", dtype="float32")
    model.save_pretrained(path)
    load_tokenizer(name).save_pretrained(path)
    load_image_processor(name).save_pretrained(path)
    # transformers before 5.22 leaves a video's per-frame pixel cap off by default, vlpack and
    # later versions have it on: the folder says which, as published folders do
    (path / "video_preprocessor_config.json").write_text(json.dumps(
        {"video_processor_type": "Qwen3VLVideoProcessor" if name.startswith("qwen3")
         else "Qwen2VLVideoProcessor", "cap_pixels_per_frame": True}))
    (path / "chat_template.jinja").write_text(GOOD_TEMPLATE)
    return path


def _rows(tmp_path: Path, rows: list) -> Path:
    """A JSONL file of `rows` (dicts; a string is written as it is: a bad record)."""
    data = tmp_path / "mine.jsonl"
    data.write_text("".join((json.dumps(r) if isinstance(r, dict) else r) + "\n" for r in rows))
    return data


def _chat(q, a: str = "A receipt.") -> dict:
    return {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}


def test_check_data_encoding_against_transformers(tmp_path, capsys, monkeypatch):
    """`--data` with a folder transformers builds a processor from: each sample's ids, grids
    and MRoPE positions equal what AutoProcessor + apply_chat_template make of it; an encoder
    that swaps an image's grid rows and columns, or one text token, passes the packed-vs-unpacked
    contract (both sides read the same encoding) but fails here, by sample and item. The
    samples cover a text row and the image row past three text rows; the bad records around
    them are skipped and named."""
    from PIL import Image

    from vlpack.data.encode import Encoder

    folder = _processor_folder(tmp_path / "ckpt", "qwen3_vl")
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 96, 3), dtype=np.uint8)).save(
        tmp_path / "a.png")
    image = _chat([{"type": "image", "image": "a.png"}, {"type": "text", "text": "What?"}])
    data = _rows(tmp_path, [_chat("Total?", "12.50"), "not json", _chat("Date?"), _chat("Hi"),
                            image, "{bad"])
    args = ["check", "--model", str(folder), "--data", str(data), "--samples", "2", "--json"]
    assert main(args) == 0
    r = _report(capsys)
    assert r["passed"] and r["sample_keys"] == ["mine.jsonl:1", "mine.jsonl:5"], r["failures"]
    assert r["data_kinds"] == {"text": 1, "image": 1}
    assert [s.split(": ")[0][-7:] for s in r["data_skipped"]] == ["jsonl:2", "jsonl:6"]
    assert r["encoding"]["compared"] == ["mine.jsonl:1", "mine.jsonl:5"]
    assert r["encoding"]["skipped"] is None and r["encoding"]["failures"] == []

    encode = Encoder.encode

    def grid_swapped(self, conv):
        s = encode(self, conv)
        s.image_grid_thw = s.image_grid_thw[:, [0, 2, 1]].copy()
        return s

    monkeypatch.setattr(Encoder, "encode", grid_swapped)
    assert main(args) == 1
    assert _report(capsys)["failures"] == [
        "encoding vs transformers: sample mine.jsonl:5: image grids [[1, 20, 14]] != "
        "transformers' [[1, 14, 20]]"]  # at the folder's image settings, as training encodes

    def token_changed(self, conv):
        s = encode(self, conv)
        s.input_ids = s.input_ids.copy()
        s.input_ids[3] += 1
        return s

    monkeypatch.setattr(Encoder, "encode", token_changed)
    from vlpack.data.sources import read_jsonl
    from vlpack.model.build import build_model
    from vlpack.model.check_encoding import compare_encoding

    model, spec = build_model(str(folder), device="cpu", dtype="float32")
    convs = [read_jsonl(_rows(tmp_path, [row]))[0] for row in (_chat("Total?"), image)]
    failures = compare_encoding(folder, convs, spec, model)["failures"]
    assert len(failures) == 2 and all("input ids differ at token 3" in f for f in failures)


def test_check_data_picks_each_kind_and_skips_bad_records(tmp_path):
    """`--data` takes one sample of each kind the file holds (text, image, frame-list video,
    video file) before more of one kind, keeps file order, and skips bad records it meets,
    naming them; once it has a sample of every kind, it reads no further (a bad record there
    does not stop it)."""
    from tests.helpers import _frames, _mp4
    from vlpack.model.build import build_model
    from vlpack.model.check_data import load_samples

    _, spec = build_model("tiny-qwen3_vl", device="meta")
    frames = _frames(tmp_path, 4, size=(64, 64))
    _frames(tmp_path, 1, size=(64, 64), name="im")
    _mp4(tmp_path / "clip.mp4", 9, fps=4)  # skips without PyAV

    def ask(item: dict) -> dict:
        return _chat([item, {"type": "text", "text": "?"}])

    rows = [_chat("a"), _chat("b"), "{bad", ask({"type": "image", "image": "gone.png"}),
            ask({"type": "video", "video": frames, "fps": 2}), _chat("c"),
            ask({"type": "image", "image": "im0.png"}), ask({"type": "video", "video": "clip.mp4"}),
            _chat("d"), "{past"]
    data = _rows(tmp_path, rows)

    def load(n: int):
        samples, _, info = load_samples(spec, samples=n, seed=0, data=str(data),
                                        model_name="tiny-qwen3_vl")
        return [s.key.split(":")[1] for s in samples], info

    keys, info = load(4)
    assert keys == ["1", "5", "7", "8"]
    assert info["data_kinds"] == {"text": 1, "image": 1, "video_frames": 1, "video_file": 1}
    assert [x.split(": ")[0].split(":")[-1] for x in info["data_skipped"]] == ["3", "4"]
    assert "gone.png" in info["data_skipped"][1]
    keys, info = load(2)
    assert keys == ["1", "5"] and info["data_kinds_left_out"] == ["image", "video_file"]


PLANTS = {
    # qwen3 families: the timestamps written before each temporal patch, one frame (0.5 s) late
    "qwen3_vl": ("timestamps", 2, "video timestamps (seconds) ['0.8', '1.8'] != transformers' "
                                  "['0.2', '1.2']"),
    # Qwen2.5-VL: second_per_grid ignored (1 s whatever the rate; 0.5 s at 4 fps)
    "qwen2_5_vl": ("second_per_grid", 4, "second_per_grid [1.0] != transformers' "
                                         "second_per_grid_ts [0.5]"),
}


@pytest.mark.parametrize("name", list(PLANTS))
def test_check_data_video_against_transformers(tmp_path, monkeypatch, name):
    """A frame-list video: compared with transformers' video processor where torchvision
    imports (ids with the qwen3 timestamps, grids, second_per_grid, positions; a planted
    timing bug fails by name); elsewhere not compared, and the report says why."""
    import importlib.util
    from dataclasses import replace

    from tests.helpers import _frames
    from vlpack.data.encode import Encoder
    from vlpack.data.sources import read_jsonl
    from vlpack.model.build import build_model
    from vlpack.model.check_encoding import compare_encoding

    field, fps, expected = PLANTS[name]
    has_torchvision = importlib.util.find_spec("torchvision") is not None
    if name != "qwen3_vl" and not has_torchvision:
        pytest.skip("transformers' video processor needs torchvision")
    folder = _processor_folder(tmp_path / "ckpt", name)
    frames = _frames(tmp_path, 4, size=(64, 64))
    video = _chat([{"type": "video", "video": frames, "fps": fps}, {"type": "text", "text": "?"}])
    model, spec = build_model(str(folder), device="cpu", dtype="float32")
    convs = read_jsonl(_rows(tmp_path, [_chat("Total?"), video]))
    e = compare_encoding(folder, convs, spec, model)
    # Qwen2/2.5-VL text after a video: where it continues is a rule transformers versions
    # disagree on (issue 34 item 4); on 5.17 this comparison names it at the first text token
    rule = [f for f in e["failures"] if name == "qwen2_5_vl" and "MRoPE positions" in f]
    assert [f for f in e["failures"] if f not in rule] == [], e
    if not has_torchvision:
        assert e["compared"] == ["mine.jsonl:1"]
        assert "needs torchvision" in e["not_compared"]["mine.jsonl:2"]
        return
    assert e["compared"] == ["mine.jsonl:1", "mine.jsonl:2"], e
    items = Encoder._items

    def bug(plan):
        return (replace(plan, timestamps=tuple(t + 0.5 for t in plan.timestamps))
                if field == "timestamps" else replace(plan, second_per_grid=1.0))

    def planted(self, conv, sizes):
        return [it if it.plan is None else replace(it, plan=bug(it.plan))
                for it in items(self, conv, sizes)]

    monkeypatch.setattr(Encoder, "_items", planted)
    failures = compare_encoding(folder, convs, spec, model)["failures"]
    assert f"encoding vs transformers: sample mine.jsonl:2: {expected}" in failures, failures


def test_check_data_reads_with_the_media_root(tmp_path, capsys):
    """`vlpack check --data` takes `--media-root` as training takes data.media_root: images
    beside the JSONL's folder are refused without it and checked with it."""
    from PIL import Image

    (tmp_path / "media").mkdir()
    (tmp_path / "data").mkdir()
    for i in range(2):
        Image.new("RGB", (64, 48), (40 * i, 9, 9)).save(tmp_path / "media" / f"{i}.png")
    rows = [{"messages": [{"role": "user", "content": [{"type": "image", "image": f"../media/{i}.png"},
                                                       {"type": "text", "text": "Total?"}]},
                          {"role": "assistant", "content": "12.50"}]} for i in range(2)]
    data = tmp_path / "data" / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["check", "--data", str(data), "--samples", "2", "--json"]
    assert main(args) == 2  # no usable sample
    capsys.readouterr()
    assert main([*args, "--media-root", str(tmp_path)]) == 0
    assert _report(capsys)["passed"]
