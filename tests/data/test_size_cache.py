"""The size cache (data/size_cache.py): reuse, invalidation by data, media and every encoder
setting, identical bad-sample accounting cold and warm, parallel measuring equal to serial, and
ranks that wait for the node's first process instead of measuring."""

from __future__ import annotations

import copy
import json
import sys
import threading
import time
from pathlib import Path

import pytest
from PIL import Image

from vlpack.config import DataConfig, VideoSettings
from vlpack.data import size_cache
from vlpack.data.encode import Encoder
from vlpack.data.loader import PackedLoader, build_loaders, measure_all, open_dataset
from vlpack.data.media import DataFile
from vlpack.data.size_cache import sample_sizes
from vlpack.data.types import BadSampleError, SampleSize


def _row(i: int) -> str:
    if i % 7 == 3:  # a missing image: a bad sample found while measuring
        content = [{"type": "image", "image": "missing.png"}, {"type": "text", "text": "What?"}]
    elif i % 2:
        content = [{"type": "image", "image": f"img{i % 4}.png"},
                   {"type": "text", "text": "Describe it " * (i % 5)}]
    else:
        content = "Say something " * (1 + i % 9)
    return json.dumps({"messages": [{"role": "user", "content": content},
                                    {"role": "assistant", "content": "ok " * (1 + i)}]})


def _write(folder: Path, n: int) -> Path:
    for k in range(4):
        Image.new("RGB", (40 + 30 * k, 60), (k * 50, 9, 9)).save(folder / f"img{k}.png")
    path = folder / "data.jsonl"
    path.write_text("".join(_row(i) + "\n" for i in range(n)) + "{not json\n")
    return path


@pytest.fixture
def data(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("VLPACK_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("SLURM_LOCALID", raising=False)
    return _write(tmp_path, 24)


@pytest.fixture(scope="module")
def enc() -> Encoder:
    return Encoder("qwen3_vl")


@pytest.fixture
def calls(monkeypatch) -> dict:
    """Calls of Encoder.measure, per thread."""
    counted: dict[int, int] = {}
    measure = Encoder.measure

    def counting(self, conv):
        counted[threading.get_ident()] = counted.get(threading.get_ident(), 0) + 1
        return measure(self, conv)

    monkeypatch.setattr(Encoder, "measure", counting)
    return counted


def _same(a, b) -> bool:
    """Equal sizes, and bad samples with the same reason and message."""
    def key(s):
        return (s.reason, str(s)) if isinstance(s, BadSampleError) else s
    return len(a) == len(b) and all(key(x) == key(y) for x, y in zip(a, b, strict=True))


def test_the_second_start_reads_the_cache(data, enc, calls) -> None:
    items = open_dataset("jsonl", str(data))
    reference = measure_all(items, enc)
    calls.clear()
    cfg = DataConfig(source="jsonl", path=str(data), seq_len=512, max_bad_fraction=0.9)
    kw = dict(seed=0, pad_token_id=0, spatial_merge_size=2)
    cold, _ = build_loaders(cfg, enc, **kw)
    assert sum(calls.values()) == 24  # the unparsable line is not measured
    assert _same(cold.sizes, reference)
    calls.clear()
    warm, _ = build_loaders(cfg, enc, **kw)
    assert sum(calls.values()) == 3  # only the bad samples are judged again
    assert _same(warm.sizes, reference)
    assert sum(isinstance(s, BadSampleError) for s in reference) == 4  # 3 missing images, 1 line


def test_bad_samples_are_accounted_the_same_cold_and_warm(data, enc) -> None:
    items = open_dataset("jsonl", str(data))

    def one_epoch(sizes):
        d = DataConfig(seq_len=512, shuffle=False, max_bad_fraction=0.9, pad_to_multiple_of=1)
        loader = PackedLoader(items, enc, d, sizes=sizes, seed=0, epochs=1, pad_token_id=0,
                              report_skips=False)
        list(loader)
        return loader.accounting

    reference = one_epoch(measure_all(items, enc))
    assert reference["skipped"] == {"bad_json": 1, "missing_image": 3}, reference
    cold = one_epoch(sample_sizes(items, enc, data))
    warm = one_epoch(sample_sizes(items, enc, data))
    assert cold == warm == reference


def test_a_changed_file_is_measured_again(data, enc, calls, caplog) -> None:
    sample_sizes(open_dataset("jsonl", str(data)), enc, data)
    _write(data.parent, 25)
    calls.clear()
    with caplog.at_level("INFO", logger="vlpack.data"):
        sizes = sample_sizes(items := open_dataset("jsonl", str(data)), enc, data)
    assert sum(calls.values()) == 25
    assert "the data changed" in caplog.text
    assert _same(sizes, measure_all(items, enc))


def test_a_changed_image_remeasures_only_its_samples(data, enc, calls, caplog) -> None:
    items = open_dataset("jsonl", str(data))
    before = sample_sizes(items, enc, data)
    Image.new("RGB", (1200, 900)).save(data.parent / "img1.png")  # rows 1, 5, 9, 13, 21 show it
    calls.clear()
    with caplog.at_level("INFO", logger="vlpack.data"):
        after = sample_sizes(items, enc, data)
    assert sum(calls.values()) == 5 + 3  # and the 3 bad samples (the bad line needs no encoder)
    assert "measuring 9 of 25 samples again (4 bad, 5 naming media that changed)" in caplog.text
    assert _same(after, measure_all(items, enc))
    assert after[1].patches > before[1].patches
    calls.clear()
    sample_sizes(items, enc, data)  # the re-measured sizes were stored
    assert sum(calls.values()) == 3


def test_a_warm_start_parses_only_the_bad_records(data, enc, monkeypatch) -> None:
    """Read from the same file, the cache stats each distinct image once and parses no record
    but the bad ones (judged again)."""
    from vlpack.data import jsonl_rows

    sample_sizes(open_dataset("jsonl", str(data)), enc, data)
    parsed, stats = [], []
    real_parse, real_stat = jsonl_rows.parse_line, size_cache.stamp
    monkeypatch.setattr(jsonl_rows, "parse_line", lambda *a: parsed.append(a[2]) or real_parse(*a))
    monkeypatch.setattr(size_cache, "stamp", lambda f: stats.append(f) or real_stat(f))
    items = open_dataset("jsonl", str(data))
    assert _same(sample_sizes(items, enc, data), measure_all(items, enc))
    assert sorted(parsed[:4]) == [4, 11, 18, 25]  # the 3 missing images and the bad line
    # odd rows name img1.png or img3.png: each distinct file is stat'd once, then the
    # re-judged bad samples stat theirs
    assert stats[:3] == [str(data.parent / n) for n in ["img1.png", "img3.png", "missing.png"]]
    assert stats[3:] == [str(data.parent / "missing.png")] * 3


def test_a_copy_elsewhere_names_its_own_files(data, enc) -> None:
    """The cache is keyed by content, so a copy of the data in another folder reads it; its bad
    samples are named by the copy's file and media paths, not the first folder's."""
    sample_sizes(open_dataset("jsonl", str(data)), enc, data)
    other = data.parent / "copy"
    other.mkdir()
    copy_ = other / "data.jsonl"
    copy_.write_bytes(data.read_bytes())
    for img in data.parent.glob("img*.png"):
        (other / img.name).write_bytes(img.read_bytes())
    items = open_dataset("jsonl", str(copy_))
    warm = sample_sizes(items, enc, copy_)
    assert _same(warm, measure_all(items, enc))
    messages = [str(s) for s in warm if isinstance(s, BadSampleError)]
    assert len(messages) == 4 and all(str(other) in m for m in messages), messages


def _word_tokenizer(words: list[str]):
    from tokenizers import Tokenizer, models

    return Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))


def _key(e: Encoder) -> str:
    return size_cache.settings_key(e.length_settings())


@pytest.mark.parametrize("kw", [
    dict(family="qwen2_5_vl"), dict(min_pixels=128 * 28 * 28), dict(max_pixels=256 * 28 * 28),
    dict(max_image_pixels=10**7), dict(tokens_per_second=4), dict(supervise_empty_think=False),
    *[dict(video=VideoSettings(**{f: v})) for f, v in [
        ("fps", 1.0), ("min_frames", 2), ("max_frames", 8), ("min_pixels", 4096),
        ("max_pixels", 10**6), ("cap_pixels_per_frame", False), ("max_video_tokens", 99)]],
])
def test_each_encoder_setting_changes_the_key(enc, kw) -> None:
    assert _key(Encoder(**{"family": "qwen3_vl", **kw})) != _key(enc)


def test_every_encoder_attribute_is_in_the_key(enc) -> None:
    """The key is built from all attributes, so a new one cannot be forgotten; the tokenizer
    and chat template count by content."""
    assert set(enc.length_settings()) == set(vars(enc))
    for name in vars(enc):
        other = copy.copy(enc)
        setattr(other, name, "changed")
        assert _key(other) != _key(enc), name
    a, b = copy.copy(enc), copy.copy(enc)
    a.tokenizer, b.tokenizer = _word_tokenizer(["a", "b"]), _word_tokenizer(["a", "c"])
    assert _key(a) != _key(b)
    b.tokenizer = _word_tokenizer(["a", "b"])  # another object, the same content
    assert _key(a) == _key(b)
    from vlpack.data.template import FolderTemplate
    a, b = copy.copy(enc), copy.copy(enc)
    a.chat_template, b.chat_template = FolderTemplate("x", "t.jinja"), FolderTemplate("y", "t.jinja")
    assert _key(a) != _key(b)
    other = copy.copy(enc)
    other.spec = object()  # an attribute the key cannot fingerprint is refused, not skipped
    with pytest.raises(TypeError, match="'spec'"):
        other.length_settings()


def test_parallel_measuring_equals_serial(tmp_path, enc, monkeypatch) -> None:
    monkeypatch.setenv("VLPACK_SIZE_CACHE", "off")
    path = _write(tmp_path, 150)
    items = open_dataset("jsonl", str(path))
    serial = sample_sizes(items, enc, path, workers=0)
    parallel = sample_sizes(items, enc, path, workers=2)
    assert _same(parallel, serial) and _same(serial, measure_all(items, enc))
    parts = size_cache.measure_parallel(items, enc, workers=2)
    assert len(parts) > 1  # it was split into shares


def test_another_rank_waits_for_the_file_and_reads_it(data, enc, calls, monkeypatch) -> None:
    items = open_dataset("jsonl", str(data))
    got = {}

    def rank1():
        got["sizes"] = sample_sizes(items, enc, data, rank=1)

    t = threading.Thread(target=rank1)
    t.start()
    time.sleep(0.5)
    assert t.is_alive()  # waiting: it does not measure
    first = sample_sizes(items, enc, data, rank=0)
    t.join(10)
    assert calls[threading.get_ident()] == 24
    assert sorted(calls.values()) == [3, 24]  # the waiting rank judged only the 3 bad samples
    assert _same(got["sizes"], first)
    monkeypatch.setattr(size_cache, "WAIT_S", 0.3)
    _write(data.parent, 3)
    with pytest.raises(TimeoutError, match="VLPACK_SIZE_CACHE=off"):
        sample_sizes(open_dataset("jsonl", str(data)), enc, data, rank=1)


def test_waiting_ranks_stop_when_the_first_process_fails(data, enc, monkeypatch) -> None:
    """The measuring process leaves a note for its launch; a note of another launch is old."""
    items = open_dataset("jsonl", str(data))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-a")
    monkeypatch.setattr(size_cache, "WAIT_S", 5.0)

    def broken(self, conv):
        raise RuntimeError("disk gone")

    with monkeypatch.context() as m:
        m.setattr(Encoder, "measure", broken)
        with pytest.raises(RuntimeError, match="disk gone"):
            sample_sizes(items, enc, data, rank=0)
    t = time.monotonic()
    with pytest.raises(RuntimeError, match=r"failed to measure.*disk gone"):
        sample_sizes(items, enc, data, rank=1)
    assert time.monotonic() - t < 2  # not the timeout
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-b")
    monkeypatch.setattr(size_cache, "WAIT_S", 0.3)
    with pytest.raises(TimeoutError):
        sample_sizes(items, enc, data, rank=1)


def test_vlpack_pack_reads_the_cache(data, calls, capsys) -> None:
    from vlpack.cli import main

    args = ["pack", str(data), "--seq-len", "1024", "--json"]
    reports = []
    for _ in range(2):
        calls.clear()
        main(args)
        reports.append(json.loads(capsys.readouterr().out))
        reports[-1].pop("seconds")
    assert reports[0] == reports[1] and reports[0]["skipped"]["missing_image"] == 3
    assert sum(calls.values()) == 3  # the second run judged only the bad samples again


def test_a_relative_media_root_is_keyed_by_the_folder_it_names(data, enc, monkeypatch) -> None:
    """`data.media_root=media` names another folder from another working directory: sizes
    measured under one are not given to the other (where the paths may lie outside it)."""
    keys = []
    monkeypatch.setattr(size_cache, "settings_key", lambda s: keys.append(s) or "k")
    for cwd in (data.parent, data.parent / "copy"):
        cwd.mkdir(exist_ok=True)
        monkeypatch.chdir(cwd)
        file = DataFile.of(data, ".")
        sample_sizes(open_dataset("jsonl", file), enc, file)
    assert [k["data.media_root"] for k in keys] == [str(data.parent), str(data.parent / "copy")]


class _Counted:
    """An encoder stub: each item's size is the item itself."""

    def measure(self, item: int) -> SampleSize:
        return SampleSize(tokens=item, patches=0)


@pytest.mark.parametrize("terminal", [False, True])
def test_the_measuring_bar_shows_on_a_terminal_only(terminal: bool, capsys, monkeypatch) -> None:
    """A log file (stderr no terminal) gets no `measuring samples` bar, whose redraws would
    pile up in it; a terminal gets it from both measuring paths."""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: terminal)
    parts = size_cache.measure_parallel([3, 4, 5], _Counted(), show_progress=True)
    assert parts[0].sizes[0].tolist() == [3, 4, 5]
    assert [s.tokens for s in measure_all([6, 7], _Counted(), show_progress=True)] == [6, 7]
    err = capsys.readouterr().err
    assert (err.count("measuring samples: 100%"), "measuring samples" in err) == (
        (2, True) if terminal else (0, False))
