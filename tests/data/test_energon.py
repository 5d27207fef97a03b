"""Energon data path with a real megatron-energon: prepare, task encoder stages, bad samples per
sample, parity with the JSONL loader, 2 ranks × 2 workers with exact resume, config checks."""

from __future__ import annotations

import importlib.util
import itertools
import json
import logging
import shutil
import tarfile
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from megatron.energon.errors import FatalSampleError
from PIL import Image

from tests.helpers import CPU, PAD, SMALL, losses, make_sample, split_data
from vlpack.cli import main
from vlpack.config import DataConfig, load_config
from vlpack.data.batch import ThdBatch
from vlpack.data.encode import Encoder
from vlpack.data.energon.loader import EnergonLoader, energon_worker_config
from vlpack.data.energon.prepare import REPORT_NAME, prepare_energon
from vlpack.data.energon.task_encoder import (
    ConversationSample,
    EncodedEnergonSample,
    QwenVLTaskEncoder,
)
from vlpack.data.loader import PackedLoader, open_dataset
from vlpack.data.synth import default_dataset
from vlpack.train.trainer import Trainer

N = 12
PIXELS = dict(min_pixels=16384, max_pixels=50176)
COMMON = dict(seq_len=1024, pad_to_multiple_of=8, overlong="truncate", max_bad_fraction=1.0, seed=0,
              pad_token_id=PAD)


def energon_loader(path: Path, encoder: Encoder, **kw) -> EnergonLoader:
    """`EnergonLoader` over the prepared folder `path` (`data.*` keywords form its section)."""
    d, run = split_data({"source": "energon", "path": str(path), **kw})
    return EnergonLoader(encoder, d, **run)


def jsonl_loader(path: Path, encoder: Encoder, **kw) -> PackedLoader:
    """The JSONL twin: `PackedLoader` over `path` with the same settings (`data.*` keywords
    form its section)."""
    d, run = split_data(kw)
    return PackedLoader(open_dataset("jsonl", str(path)), encoder, d, **run)


@pytest.fixture(scope="module")
def encoder() -> Encoder:
    return Encoder("qwen3_vl", **PIXELS)


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> tuple[Path, Path]:
    """(JSONL, prepared Energon folder) of N synthetic samples in 4 shards."""
    src = default_dataset(n=N)
    out = tmp_path_factory.mktemp("energon") / "ds"
    prepare_energon(src, out, shard_size=3)
    return src, out


@pytest.fixture(scope="module")
def dirty(tmp_path_factory) -> tuple[Path, Path, dict]:
    """Synthetic samples plus one record per failure: (JSONL, Energon folder, prepare report)."""
    root = tmp_path_factory.mktemp("dirty")
    shutil.copytree(default_dataset(n=N).parent, root / "src")
    (root / "src" / "corrupt.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    Image.new("RGB", (2000, 5)).save(root / "src" / "thin.png")
    ask = [{"type": "image", "image": "images/000001_0.jpg"}, {"type": "text", "text": "Total?"}]

    def rec(i: str, user, answer: str = "12.50") -> str:
        return json.dumps({"id": i, "messages": [{"role": "user", "content": user},
                                                 {"role": "assistant", "content": answer}]})

    extra = [
        "{not json",  # bad_json (left out by prepare)
        rec("missing", [{"type": "image", "image": "nope.jpg"}]),  # missing_image (prepare)
        rec("corrupt", [{"type": "image", "image": "corrupt.jpg"}]),  # corrupt_image (prepare)
        rec("thin", [{"type": "image", "image": "thin.png"}]),  # bad_image_size
        rec("long_answer", ask, "word " * 3000),  # truncated (or overlong with skip)
        rec("long_prompt", "word " * 3000),  # overlong_prompt when truncated
    ]
    with (root / "src" / "data.jsonl").open("a") as f:
        f.write("\n".join(extra) + "\n")
    report = prepare_energon(root / "src" / "data.jsonl", root / "ds", shard_size=5)
    return root / "src" / "data.jsonl", root / "ds", report


def rows(loader, n: int) -> list[ThdBatch]:
    return list(itertools.islice(iter(loader), n))


def epoch_rows(loader, n_samples: int) -> list[ThdBatch]:
    """Rows until they hold n_samples samples (one pass when one buffer holds the epoch)."""
    out = []
    for b in loader:
        out.append(b)
        if sum(r.num_samples for r in out) >= n_samples:
            return out
    raise AssertionError("stream ended")


def same_rows(a: list[ThdBatch], b: list[ThdBatch]) -> None:
    assert [x.sample_keys for x in a] == [y.sample_keys for y in b]
    for x, y in zip(a, b, strict=True):
        for name in ("input_ids", "labels", "position_ids", "cu_seqlens_padded", "image_grid_thw"):
            assert torch.equal(getattr(x, name), getattr(y, name)), name
        assert (x.pixel_values is None) == (y.pixel_values is None)
        if x.pixel_values is not None:
            assert torch.equal(x.pixel_values, y.pixel_values)


# --------------------------------------------------------------------------- prepare


def test_prepare_writes_shards_and_energon_metadata(clean) -> None:
    src, out = clean
    meta = out / ".nv-meta"
    assert {"dataset.yaml", "split.yaml", "index.sqlite", ".info.json"} <= {p.name for p in meta.iterdir()}
    assert "CrudeWebdataset" in (meta / "dataset.yaml").read_text()
    assert sorted(p.name for p in out.glob("*.tar")) == [f"shard-{i:06d}.tar" for i in range(4)]
    report = json.loads((out / REPORT_NAME).read_text())
    assert (report["samples"], report["shards"], report["skipped"]) == (N, 4, {})
    with tarfile.open(out / "shard-000000.tar") as tar:
        names = tar.getnames()
        record = json.loads(tar.extractfile("000000000.json").read())
        image = tar.extractfile(next(n for n in names if n.startswith("000000000.img0"))).read()
    first = json.loads(src.read_text().splitlines()[0])
    assert record["id"] == first["id"]
    originals = [c["image"] for m in first["messages"] if isinstance(m["content"], list)
                 for c in m["content"] if c.get("type") == "image"]
    assert image == (src.parent / originals[0]).read_bytes()  # bytes copied verbatim


def test_prepare_pairs_each_record_with_its_own_media(tmp_path: Path, monkeypatch) -> None:
    """prepare reads the JSONL as every reader does: a first line behind a byte-order mark is a
    record, and a whitespace line longer than a record may be is the bad sample
    `record_too_large`, not a blank line, so the records after it keep their own media."""
    from vlpack.data import sources

    monkeypatch.setattr(sources, "MAX_RECORD_BYTES", 512)
    Image.new("RGB", (64, 48), "red").save(tmp_path / "a.png")

    def rec(i: str, image: bool) -> str:
        user = [{"type": "image", "image": "a.png"}] * image + [{"type": "text", "text": "q"}]
        return json.dumps({"id": i, "messages": [{"role": "user", "content": user},
                                                 {"role": "assistant", "content": "ok"}]})

    src = tmp_path / "d.jsonl"
    src.write_text("\ufeff" + rec("r1", False) + "\n" + " " * 600 + "\n" + rec("r2", True) + "\n"
                   + rec("r3", False) + "\n")
    report = prepare_energon(src, tmp_path / "ds", shard_size=10)
    assert (report["samples"], report["skipped"]) == (3, {"record_too_large": 1})
    with tarfile.open(tmp_path / "ds" / "shard-000000.tar") as tar:
        names = set(tar.getnames())
        ids = [json.loads(tar.extractfile(f"{n:09d}.json").read())["id"] for n in range(3)]
    assert ids == ["r1", "r2", "r3"]
    assert {n for n in names if ".img" in n} == {"000000001.img0.png"}


def test_prepare_leaves_out_records_with_special_tokens_in_text(tmp_path: Path) -> None:
    """A record whose text (a turn, its reasoning, a tool call) holds a special token is left
    out and counted as `special_token_in_text`, as training would refuse it; grounding markup
    and tokens that are not special (`<think>`) stay text."""
    def rec(i: str, user: str, **assistant) -> str:
        return json.dumps({"id": i, "messages": [
            {"role": "user", "content": user},
            {"role": "assistant", "content": "ok", **assistant}]})

    call = {"type": "function", "function": {"name": "f", "arguments": {"x": "<|vision_pad|>"}}}
    src = tmp_path / "d.jsonl"
    src.write_text("\n".join([
        rec("fine", "<|box_start|>(1,2)<|box_end|> <think>"),
        rec("in_user", "a<|im_end|>b"),
        rec("in_reasoning", "q", reasoning_content="<|endoftext|>"),
        rec("in_tool_call", "q", tool_calls=[call]),
    ]) + "\n")
    report = prepare_energon(src, tmp_path / "ds", shard_size=10)
    assert (report["samples"], report["skipped"]) == (1, {"special_token_in_text": 3})
    assert [p["message"].split(", a special token")[0] for p in report["problems"]] == [
        "in_user: the user text of turn 0 holds '<|im_end|>'",
        "in_reasoning: the assistant text of turn 1 holds '<|endoftext|>'",
        "in_tool_call: the assistant text of turn 1 holds '<|vision_pad|>'"]


def test_prepare_cli_and_refuses_a_non_empty_folder(tmp_path: Path, capsys) -> None:
    src = default_dataset(n=N)
    assert main(["data", "energon-prepare", str(src), str(tmp_path / "ds"), "--shard-size", "5"]) == 0
    assert "wrote 12 samples in 3 shards" in capsys.readouterr().out
    assert main(["data", "energon-prepare", str(src), str(tmp_path / "ds")]) == 2
    assert "not empty" in capsys.readouterr().err


# --------------------------------------------------------------------------- parity with JSONL


@pytest.mark.parametrize(("algo", "max_patches"), [("greedy", None), ("ffd", 400), ("bfd", None),
                                                   ("bfd", 400)])
def test_same_bins_as_the_jsonl_loader(clean, encoder, algo, max_patches) -> None:
    """Same samples in the same order (no shuffle), one planning round over all of them: the
    JSONL planner's first round (buffer > N, flushed at the epoch boundary) and Energon's first
    buffer (N samples) give the same rows in the same order."""
    src, out = clean
    kw = dict(COMMON, packing=algo, max_patches=max_patches, shuffle=False)
    energon = energon_loader(out, encoder, packing_buffer_size=N, **kw)
    jsonl = jsonl_loader(src, encoder, buffer_size=N + 1, epochs=None, **kw)
    a, b = epoch_rows(energon, N), epoch_rows(jsonl, N)
    same_rows(a, b)
    assert energon.accounting["samples"] == N and not energon.accounting["skipped"]
    if max_patches:
        assert max(int(r.image_grid_thw.prod(dim=1).sum()) for r in a) <= max_patches
    assert max(r.num_tokens for r in a) <= 1024


def test_rows_padded_to_seq_len_as_on_the_jsonl_path(clean, encoder) -> None:
    """data.pad_to_seq_len reaches Energon's rows as it reaches the JSONL loader's."""
    src, out = clean
    kw = dict(COMMON, packing="bfd", shuffle=False, pad_to_seq_len=True)
    a = epoch_rows(energon_loader(out, encoder, packing_buffer_size=N, **kw), N)
    b = epoch_rows(jsonl_loader(src, encoder, buffer_size=N + 1, epochs=None, **kw), N)
    same_rows(a, b)
    assert {r.input_ids.numel() for r in a} == {COMMON["seq_len"]}


# --------------------------------------------------------------------------- bad samples


def test_bad_samples_cost_only_themselves(dirty, encoder) -> None:
    src, out, report = dirty
    assert report["skipped"] == {"bad_json": 1, "corrupt_image": 1, "missing_image": 1}
    kept = report["samples"]  # N good + thin, long_answer, long_prompt
    loader = energon_loader(out, encoder, packing="bfd", packing_buffer_size=kept, shuffle=False,
                           **COMMON)  # fmt: skip
    got = epoch_rows(loader, N + 1)
    acc = loader.accounting
    assert acc["skipped"] == {"bad_image_size": 1, "overlong_prompt": 1}
    assert (acc["samples"], acc["packed"], acc["truncated"]) == (kept, N, 1)
    keys = Counter(k for r in got for k in r.sample_keys)
    assert len(keys) == N + 1 and set(keys.values()) == {1} and "long_answer" in keys
    # The JSONL path counts the same samples under the same reasons (it also sees the three
    # that prepare left out).
    jsonl = jsonl_loader(src, encoder, packing="bfd", buffer_size=64, epochs=1, shuffle=False,
                         **COMMON)  # fmt: skip
    list(jsonl)
    merged = Counter(acc["skipped"]) + Counter(report["skipped"])
    assert jsonl.accounting["skipped"] == dict(merged)
    assert jsonl.accounting["truncated"] == 1


def test_skips_are_summarized_once_per_reason(dirty, encoder, caplog) -> None:
    """No line per skip (Energon encodes a sample again in each buffer and worker): the loader
    logs one line per reason, with the count so far and one sample it skipped, when asked
    (at the end of training) and then only for reasons with new skips."""
    _, out, report = dirty
    loader = energon_loader(out, encoder, packing="bfd", packing_buffer_size=report["samples"],
                            shuffle=False, **COMMON)  # fmt: skip
    with caplog.at_level("WARNING", logger="vlpack.data"):
        epoch_rows(loader, N + 1)
        assert not caplog.records
        loader.summarize_skips()
        lines = [r.getMessage() for r in caplog.records]
        caplog.clear()
        loader.summarize_skips()
        assert not caplog.records
    assert [line.split(": ", 1)[0] for line in lines] == [
        "skipped 1 sample(s) so far (bad_image_size), e.g. thin",
        "skipped 1 sample(s) so far (overlong_prompt), e.g. long_prompt"]


def test_a_sample_that_raises_anything_is_counted(encoder) -> None:
    """A sample whose encoding raises another exception than BadSampleError becomes the marker
    `encode_error`, named and held to the bad-sample limits (Energon would drop it uncounted);
    its message rides with the marker, for the loader's summary (which prints it escaped)."""
    d = DataConfig(seq_len=64, packing="bfd", max_consecutive_bad=1, pad_to_multiple_of=1)
    te = QwenVLTaskEncoder(encoder, d, seed=0, pad_token_id=PAD)

    def broken(sample):
        raise TypeError("the tokenizer took no \x1b[31mtext")

    te._encode = broken
    sample = ConversationSample(__key__="k7", __restore_key__=("x", 7), record={}, media={})
    out = te.encode_sample(sample)
    assert out.encoded is None and out.status == "encode_error"
    assert out.message == "k7: TypeError: the tokenizer took no \x1b[31mtext"
    with pytest.raises(FatalSampleError, match=r"2 bad samples in a row \(last: encode_error"):
        te.encode_sample(sample)


def test_overlong_skip_and_error(dirty, encoder) -> None:
    _, out, report = dirty
    kw = dict(COMMON, packing="ffd", packing_buffer_size=report["samples"], shuffle=False)
    kw["overlong"] = "skip"
    loader = energon_loader(out, encoder, **kw)
    epoch_rows(loader, N)
    assert loader.accounting["skipped"]["overlong"] == 2
    kw["overlong"] = "error"
    with pytest.raises(ValueError, match=r"overlong .*data.overlong=truncate"):
        rows(energon_loader(out, encoder, **kw), 1)


def test_selection_never_raises_and_keeps_markers(encoder) -> None:
    """A buffer of good samples and markers: every sample in exactly one group; the markers
    ride in the first group; a buffer of markers only becomes one filler group."""
    rng = np.random.default_rng(0)
    d = DataConfig(seq_len=64, packing="bfd", max_patches=40, pad_to_multiple_of=1)
    te = QwenVLTaskEncoder(encoder, d, seed=0, pad_token_id=PAD)

    def wrap(i, sample, status="packed"):
        return EncodedEnergonSample(__key__=f"k{i}", __restore_key__=("x", i), encoded=sample,
                                    status=status)  # fmt: skip

    good = [wrap(i, make_sample(f"s{i}", rng, text=(4, 9), grids=((1, 4, 4),))) for i in range(6)]
    bad = [wrap(10, None, "corrupt_image"), wrap(11, None, "overlong"),
           wrap(12, make_sample("huge", rng, text=(4, 90), grids=((1, 4, 4),)))]  # slipped through
    groups = te.select_samples_to_pack([*good[:3], *bad, *good[3:]])
    flat = [s.__key__ for g in groups for s in g]
    assert sorted(flat) == sorted(s.__key__ for s in [*good, *bad])
    assert {s.__key__ for s in groups[0]} >= {"k10", "k11", "k12"}
    assert bad[2].status == "overlong" and bad[2].encoded is None
    for g in groups:
        sizes = [s.encoded for s in g if s.encoded is not None]
        assert sum(-(-len(s) // 1) for s in sizes) <= 64
        assert sum(s.num_patches for s in sizes) <= 40
    row = te.batch([te.pack_selected_samples(groups[0])])
    assert row.skipped == {"corrupt_image": 1, "overlong": 2} and not row.filler
    only_bad = te.select_samples_to_pack([wrap(20, None, "bad_json")])
    row = te.batch([te.pack_selected_samples(only_bad[0])])
    assert row.filler and row.skipped == {"bad_json": 1} and row.batch.num_label_tokens == 0


# --------------------------------------------------------------------------- ranks and resume


def test_two_ranks_two_workers_distinct_streams_and_exact_resume(clean, encoder) -> None:
    _, out = clean
    kw = dict(COMMON, packing="bfd", packing_buffer_size=2, num_workers=2, world_size=2)
    streams = {}
    for rank in (0, 1):
        straight = rows(energon_loader(out, encoder, rank=rank, **kw), 6)
        first = energon_loader(out, encoder, rank=rank, **kw)
        head = rows(first, 3)
        state = first.state_dict()
        resumed = energon_loader(out, encoder, rank=rank, **kw)
        resumed.load_state_dict(state)
        same_rows(straight, head + rows(resumed, 3))
        assert resumed.accounting["samples"] >= first.accounting["samples"]
        streams[rank] = {k for r in straight for k in r.sample_keys}
    # Energon gives each of the 2×2 workers its own quarter of the samples.
    assert streams[0] and streams[1] and not streams[0] & streams[1]


def test_worker_config_from_torch_distributed(tmp_path: Path) -> None:
    wc = energon_worker_config(2, rank=1, world_size=2)
    assert (wc.rank, wc.world_size, wc.num_workers) == (1, 2, 2)
    if torch.distributed.is_initialized():
        pytest.skip("a process group already exists in this process")
    assert (energon_worker_config(0).rank, energon_worker_config(0).world_size) == (0, 1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}",
                                         rank=0, world_size=1)  # fmt: skip
    try:
        group = torch.distributed.new_group([0])
        wc = energon_worker_config(0, group=group)
        assert (wc.rank, wc.world_size, wc.data_parallel_group) == (0, 1, group)
    finally:
        torch.distributed.destroy_process_group()
    with pytest.raises(ValueError, match="both rank and world_size"):
        energon_worker_config(0, rank=1)


# --------------------------------------------------------------------------- config


@pytest.mark.parametrize(("overrides", "match"), [
    (["data.packing_buffer_size=8"], r"data.packing_buffer_size .*data.buffer_size"),
    (["data.shuffle_buffer_size=8"], r"data.shuffle_buffer_size .*mutually exclusive"),
    (["data.source=energon", "data.path=x", "data.packing=none"],
     r"data.packing=none .*data.packing_buffer_size"),
    (["data.source=energon", "data.path=x", "data.shuffle=false", "data.shuffle_buffer_size=4"],
     "contradicts"),
    (["data.source=energon", "data.path=x", "data.packing_buffer_size=0"], "must be > 0"),
])  # fmt: skip
def test_config_rejects_mixed_packing_modes(overrides, match) -> None:
    with pytest.raises(ValueError, match=match):
        load_config(None, overrides)


def test_loader_refuses_an_unprepared_folder(tmp_path: Path, encoder) -> None:
    with pytest.raises(ValueError, match="energon-prepare"):
        energon_loader(tmp_path, encoder, **COMMON)


# --------------------------------------------------------------------------- untrusted metadata

HOOK_PY = """from pathlib import Path
Path({marker!r}).write_text("code from the dataset folder ran")
def sample_loader(raw):
    return raw
def part_filter(part):
    return True
"""
SHARD0 = "shard-000000.tar"


def planted(clean, tmp_path: Path) -> tuple[Path, Path]:
    """(a copy of the clean dataset with `.nv-meta/sample_loader.py` planted, the marker file
    that code writes when it runs)."""
    ds, marker = tmp_path / "ds", tmp_path / "PWNED"
    shutil.copytree(clean[1], ds)
    (ds / ".nv-meta" / "sample_loader.py").write_text(HOOK_PY.format(marker=str(marker)))
    return ds, marker


def load_refused(ds: Path, encoder: Encoder, match: str) -> None:
    """Building the loader and Energon's dataset from `ds` raises ValueError matching `match`."""
    with pytest.raises(ValueError, match=match):
        energon_loader(ds, encoder, shuffle=False, **COMMON)._loader()


@pytest.mark.parametrize("dataset_yaml", [
    # the review's repro: a standard factory with both code hooks
    "__module__: megatron.energon\n__class__: StandardWebdatasetFactory\n"
    "sample_type: {__module__: megatron.energon, __class__: TextSample}\n"
    "sample_loader: sample_loader.py:sample_loader\npart_filter: sample_loader.py:part_filter\n",
    # the accepted class with a part_filter hook
    "__module__: megatron.energon\n__class__: CrudeWebdataset\n"
    "part_filter: sample_loader.py:part_filter\n",
    # a class vlpack does not write
    "__module__: megatron.energon\n__class__: StandardWebdatasetFactory\n"
    "sample_type: {__module__: megatron.energon, __class__: TextSample}\n",
    # an object hidden in subflavors
    "__module__: megatron.energon\n__class__: CrudeWebdataset\n"
    "subflavors: {x: {__module__: os, __function__: getcwd}}\n",
    # a key vlpack does not write
    "__module__: megatron.energon\n__class__: CrudeWebdataset\nauxiliary: {}\n",
])  # fmt: skip
def test_dataset_yaml_with_code_hooks_or_other_classes_is_refused(clean, encoder, tmp_path,
                                                                  dataset_yaml) -> None:
    ds, marker = planted(clean, tmp_path)
    (ds / ".nv-meta" / "dataset.yaml").write_text(dataset_yaml)
    load_refused(ds, encoder, r"dataset\.yaml.*(energon-prepare|remove)")
    assert not marker.exists()  # the planted code never ran


def test_prepared_dataset_with_plain_subflavors_loads(clean, encoder, tmp_path) -> None:
    ds, marker = planted(clean, tmp_path)
    with (ds / ".nv-meta" / "dataset.yaml").open("a") as f:
        f.write("subflavors: {source: synth, weight: 1}\n")
    loader = energon_loader(ds, encoder, shuffle=False, **COMMON)
    assert rows(loader, 1)
    loader.close()
    assert not marker.exists()


@pytest.mark.parametrize("entry", ["../outside/" + SHARD0, "{OUT}/" + SHARD0,
                                   "{shard-000001.tar,../outside/" + SHARD0 + "}"])
def test_split_naming_a_shard_outside_the_folder_is_refused(clean, encoder, tmp_path,
                                                            entry) -> None:
    ds, _ = planted(clean, tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    for suffix in ("", ".idx"):
        shutil.copy(ds / (SHARD0 + suffix), outside / (SHARD0 + suffix))
    entry = entry.replace("{OUT}", str(outside))
    meta = ds / ".nv-meta"
    (meta / "split.yaml").write_text(f"split_parts:\n  train:\n  - '{entry}'\nexclude: []\n")
    info = json.loads((meta / ".info.json").read_text())
    name = entry.replace("{shard-000001.tar,", "").rstrip("}")
    info["shard_counts"][name] = info["shard_counts"][SHARD0]  # as Energon would need it
    (meta / ".info.json").write_text(json.dumps(info))
    load_refused(ds, encoder, r"split\.yaml.*outside the dataset folder")


def test_shard_symlinked_outside_or_info_naming_one_is_refused(clean, encoder, tmp_path) -> None:
    ds, _ = planted(clean, tmp_path)
    outside = tmp_path / "elsewhere.tar"
    shutil.move(ds / SHARD0, outside)
    (ds / SHARD0).symlink_to(outside)
    load_refused(ds, encoder, r"shard 'shard-000000.tar' \(entry 'shard-\{000000..000003\}.tar'\) "
                              r"of .*split\.yaml.*outside")
    (ds / SHARD0).unlink()
    shutil.move(outside, ds / SHARD0)
    info = json.loads((ds / ".nv-meta" / ".info.json").read_text())
    info["shard_counts"]["/etc/passwd"] = 1
    (ds / ".nv-meta" / ".info.json").write_text(json.dumps(info))
    load_refused(ds, encoder, r"\.info\.json.*outside the dataset folder")


def test_data_path_to_a_metadataset_yaml_is_refused(encoder, tmp_path) -> None:
    mds = tmp_path / "metadataset.yaml"
    mds.write_text("__module__: megatron.energon\n__class__: MetadatasetV2\nsplits: {}\n")
    load_refused(mds, encoder, "not a prepared Energon dataset")


def test_warns_when_a_buffer_exceeds_a_workers_share(clean, encoder, caplog) -> None:
    _, out = clean
    with caplog.at_level("WARNING", logger="vlpack.data.energon.loader"):
        energon_loader(out, encoder, packing_buffer_size=N // 4, num_workers=2, rank=0, world_size=2,
                      **COMMON)  # fmt: skip
        assert not caplog.records
        energon_loader(out, encoder, packing_buffer_size=N // 4 + 1, num_workers=2, rank=0,
                      world_size=2, **COMMON)  # fmt: skip
    assert "at most 3" in caplog.text


def test_video_samples_pack_as_on_the_jsonl_path(tmp_path: Path, encoder) -> None:
    """Frame-list and container videos, mixed with an image, through `energon-prepare`: the
    shards hold the files as members and the rows equal the JSONL loader's."""
    from tests.helpers import _frames, _mp4

    src = tmp_path / "src"
    a = [f"clipA/{n}" for n in _frames(src / "clipA", 5, size=(60, 90))]
    b = [f"clipB/{n}" for n in _frames(src / "clipB", 4, size=(48, 64), seed=1)]
    _frames(src, 1, size=(64, 64), name="im")
    rows = [
        {"id": "v-frames", "messages": [
            {"role": "user", "content": [{"type": "video", "video": a, "fps": 2},
                                         {"type": "text", "text": "What happens?"}]},
            {"role": "assistant", "content": "A receipt appears."}]},
        {"id": "v-share", "conversations": [
            {"from": "human", "value": "<image> then <video>"}, {"from": "gpt", "value": "ok"}],
         "image": "im0.png", "video": b},
    ]
    if importlib.util.find_spec("av"):
        _mp4(src / "clip.mp4", 17, fps=8)
        rows.append({"id": "v-file", "messages": [
            {"role": "user", "content": [{"type": "video", "video": "clip.mp4"}]},
            {"role": "assistant", "content": "A clip."}]})
    data = src / "videos.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "ds"
    report = prepare_energon(data, out, shard_size=2)
    assert report["samples"] == len(rows) and not report["skipped"]
    with tarfile.open(out / "shard-000000.tar") as tar:
        names = tar.getnames()
    assert "000000000.vid0f004.png" in names and "000000001.vid0f000.png" in names
    kw = dict(COMMON, packing="bfd", shuffle=False)
    energon = energon_loader(out, encoder, packing_buffer_size=len(rows), **kw)
    jsonl = jsonl_loader(data, encoder, buffer_size=len(rows) + 1, epochs=None, **kw)
    got, want = epoch_rows(energon, len(rows)), epoch_rows(jsonl, len(rows))
    same_rows(got, want)
    assert sum(int((r.mm_token_type_ids == 2).sum()) for r in got) > 0


def test_without_energon_installed_the_install_is_named(monkeypatch, tmp_path) -> None:
    """Megatron-Energon is an optional extra: without it, the commands that need it say how to
    install it instead of failing on an import."""
    import importlib.util

    from vlpack.data.energon.prepare import prepare_energon

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith("megatron") else real(name, *a))
    with pytest.raises(ValueError, match=r"pip install 'vlpack\[energon\]'"):
        prepare_energon(tmp_path / "data.jsonl", tmp_path / "out")
    from vlpack.config import DataConfig
    from vlpack.data.loader import build_loaders

    cfg = DataConfig(source="energon", path=str(tmp_path))
    with pytest.raises(ValueError, match=r"data.source=energon needs Megatron-Energon"):
        build_loaders(cfg, None, seed=0, pad_token_id=0, spatial_merge_size=2)


# --- training on an Energon dataset ------------------------------------------------------------------
# `vlpack train data.source=energon`: the same first bins and first-step loss as the JSONL path on the
# same samples, planner and seed; resume continues the Energon stream exactly.


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> tuple[Path, Path]:
    src = default_dataset(n=N)
    out = tmp_path_factory.mktemp("energon-train") / "ds"
    prepare_energon(src, out, shard_size=5)
    return src, out


def cfg(out: Path, *extra: str):
    return load_config("tiny", [*SMALL, f"train.output_dir={out}", "data.shuffle=false",
                                   "model.init=random", *extra])


def test_first_bins_and_first_step_loss_equal_the_jsonl_path(data, tmp_path: Path) -> None:
    """No shuffle and one planning round over the N samples on both paths: the JSONL planner's
    buffer is larger than the dataset (its first round is the flush at the epoch boundary),
    Energon's buffer is the dataset. See docs/energon.md for when the paths differ."""
    src, ds = data
    jsonl = Trainer(cfg(tmp_path / "j", "data.source=jsonl", f"data.path={src}",
                        f"data.buffer_size={N + 1}", "train.max_steps=2"), CPU)  # fmt: skip
    energon = Trainer(cfg(tmp_path / "e", "data.source=energon", f"data.path={ds}",
                          f"data.packing_buffer_size={N}", "train.max_steps=2"), CPU)  # fmt: skip
    first = [next(iter(t.train_loader)) for t in (jsonl, energon)]
    assert first[0].sample_keys == first[1].sample_keys
    assert torch.equal(first[0].input_ids, first[1].input_ids)
    jsonl.train_loader.load_state_dict({"consumed": 0})  # rewind both streams
    energon.train_loader.close()
    sj, se = jsonl.fit(), energon.fit()
    assert se["first_loss"] == pytest.approx(sj["first_loss"], abs=1e-6)
    assert losses(tmp_path / "e") == pytest.approx(losses(tmp_path / "j"), abs=1e-5)


def test_energon_training_resumes_exactly(data, tmp_path: Path) -> None:
    _, ds = data
    args = ("data.source=energon", f"data.path={ds}", "data.packing_buffer_size=6",
            "data.num_workers=2", "train.max_steps=4")  # fmt: skip
    Trainer(cfg(tmp_path / "a", *args), CPU).fit()
    Trainer(cfg(tmp_path / "b", *args[:-1], "train.max_steps=2"), CPU).fit()
    resumed = Trainer(cfg(tmp_path / "b", *args), CPU)
    summary = resumed.fit()
    assert losses(tmp_path / "a") == losses(tmp_path / "b")
    assert summary["skipped"] == {} and summary["steps"] == 4
    rows = [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]


def test_vlpack_train_command_runs_on_an_energon_dataset(data, tmp_path: Path, capsys) -> None:
    from vlpack.cli import main

    _, ds = data
    assert main(["train", *SMALL, "data.source=energon", f"data.path={ds}", "train.max_steps=1",
                 "model.init=random",
                 f"train.output_dir={tmp_path}"]) == 0  # fmt: skip
    assert "vlpack: done" in capsys.readouterr().out
    assert len(losses(tmp_path)) == 1


def test_energon_training_prints_one_line_per_skip_reason(dirty, tmp_path: Path, caplog) -> None:
    _, ds, report = dirty
    caplog.set_level(logging.WARNING, logger="vlpack.data")
    summary = Trainer(cfg(tmp_path, "data.source=energon", f"data.path={ds}", "train.max_steps=2",
                          "data.overlong=truncate", "data.max_bad_fraction=1.0",
                          f"data.packing_buffer_size={report['samples']}"), CPU).fit()
    assert summary["skipped"] == {"bad_image_size": 1, "overlong_prompt": 1}
    lines = [r.getMessage() for r in caplog.records if "skip" in r.getMessage()]
    assert [line.split(": ", 1)[0] for line in lines] == [
        "skipped 1 sample(s) so far (bad_image_size), e.g. thin",
        "skipped 1 sample(s) so far (overlong_prompt), e.g. long_prompt"]


def test_a_hostile_energon_state_is_refused_without_running(tmp_path: Path) -> None:
    """Energon's state in a checkpoint is read with weights_only: bytes that would call a
    function on load are refused by name, and the function never runs."""
    import io

    from tests.train.run.test_checkpoint import _TouchOnLoad
    from vlpack.data.energon.loader import _load_energon_state

    ran = tmp_path / "ran"
    buf = io.BytesIO()
    torch.save({"workers": [_TouchOnLoad(ran)]}, buf)
    with pytest.raises(ValueError, match="an Energon loader state in this checkpoint names"):
        _load_energon_state(buf.getvalue())
    assert not ran.exists()
