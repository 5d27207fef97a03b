"""Hugging Face datasets as a source (data/hf_source.py): a real `datasets` dataset written here
equals the same records as JSONL with image files, sample for sample; bad rows are named by row;
the loader plans and resumes over it exactly."""

from __future__ import annotations

import contextlib
import itertools
import json
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from vlpack.cli import main
from vlpack.config import DataConfig
from vlpack.data.encode import Encoder
from vlpack.data.loader import PackedLoader, open_dataset
from vlpack.data.media import ORIENTATION, DataFile
from vlpack.data.types import BadSampleError, Conversation, ImageRef

datasets = pytest.importorskip("datasets")


def _jpeg(orientation: int) -> bytes:
    """A 96×64 picture, left half red, with the EXIF orientation `orientation`, as JPEG bytes."""
    import io

    a = np.zeros((64, 96, 3), np.uint8)
    a[:, :48, 0] = 255
    exif = Image.Exif()
    exif[ORIENTATION] = orientation
    out = io.BytesIO()
    Image.fromarray(a).save(out, format="JPEG", exif=exif.tobytes())
    return out.getvalue()


def _turns(question: str, answer: str, image: bool) -> list[dict]:
    user = ([{"type": "image", "text": None}] if image else []) + [{"type": "text", "text": question}]
    return [{"role": "user", "content": user},
            {"role": "assistant", "content": [{"type": "text", "text": answer}]}]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> tuple[Path, Path]:
    """(the save_to_disk folder, the same records as a JSONL file with image files)."""
    root = tmp_path_factory.mktemp("hf")
    turned, upright = _jpeg(6), _jpeg(1)
    (root / "files").mkdir()
    (root / "files" / "turned.jpg").write_bytes(turned)
    (root / "ds").mkdir()
    (root / "ds" / "upright.jpg").write_bytes(upright)
    (root / "files" / "upright.jpg").write_bytes(upright)
    rows = [  # (id, question, answer, images as the Image column holds them)
        ("t0", "Hi", "Hello", []),
        (None, "Which side is red?", "left", [{"bytes": turned, "path": None}]),
        ("p2", "And here?", "left", [{"bytes": None, "path": "upright.jpg"}]),
        (None, "Broken?", "yes", [{"bytes": b"not an image", "path": None}]),
        ("two", "Both?", "yes", [{"bytes": upright, "path": None}, {"bytes": turned, "path": None}]),
    ]
    msgs = [_turns(q, a, bool(im)) for _, q, a, im in rows]
    msgs[4][0]["content"].insert(0, {"type": "image", "text": None})
    features = datasets.Features({
        "id": datasets.Value("string"),
        "messages": datasets.List({"role": datasets.Value("string"), "content": datasets.List(
            {"type": datasets.Value("string"), "text": datasets.Value("string")})}),
        "images": datasets.List(datasets.Image()),
    })  # fmt: skip
    ds = datasets.Dataset.from_dict(
        {"id": [r[0] for r in rows], "messages": msgs, "images": [r[3] for r in rows]},
        features=features)
    with contextlib.chdir(root / "ds"):  # save_to_disk embeds a path-only image's bytes
        ds.save_to_disk(str(root / "ds"))
    names = {0: [], 1: ["turned.jpg"], 2: ["upright.jpg"], 4: ["upright.jpg", "turned.jpg"]}
    with (root / "files" / "data.jsonl").open("w") as f:
        for n in (0, 1, 2, 4):  # the rows that are good, as JSONL
            conv = [{"from": "human", "value": "<image>" * len(names[n]) + rows[n][1]},
                    {"from": "gpt", "value": rows[n][2]}]
            f.write(json.dumps({"conversations": conv, "images": names[n]}) + "\n")
    return root / "ds", root / "files" / "data.jsonl"


def _content(conv: Conversation) -> list:
    """Roles, text and image bytes of `conv` (image names differ between files)."""
    return [(m.role, [c.data if isinstance(c, ImageRef) else c for c in m.content])
            for m in conv.messages]


@pytest.fixture(scope="module")
def enc() -> Encoder:
    return Encoder("qwen3_vl", min_pixels=16384, max_pixels=50176)


def test_rows_encode_as_the_same_jsonl_records(data, enc) -> None:
    rows = open_dataset("hf", str(data[0]))
    jsonl = open_dataset("jsonl", str(data[1]))
    assert len(rows) == 5
    good = [rows[n] for n in (0, 1, 2, 4)]
    assert all(isinstance(c, Conversation) for c in good)
    for hf, ref in zip(good, jsonl, strict=True):
        a, b = enc.encode(hf), enc.encode(ref)
        assert np.array_equal(a.input_ids, b.input_ids) and np.array_equal(a.labels, b.labels)
        assert np.array_equal(a.image_grid_thw, b.image_grid_thw)
        assert (a.pixel_values is None) == (b.pixel_values is None)
        if a.pixel_values is not None:  # the EXIF-turned bytes decode upright, as the file does
            assert np.array_equal(a.pixel_values, b.pixel_values)
        assert enc.measure(hf) == enc.measure(ref)
    assert enc.measure(rows[1]) != enc.measure(rows[2])  # 64×96 upright vs 96×64


def test_bad_rows_are_named_by_row(data, enc) -> None:
    rows = open_dataset("hf", str(data[0]))
    assert rows[0].key == "t0" and rows[0].where == "ds[0]" and rows[1].key == "ds[1]"
    with pytest.raises(BadSampleError, match=r"ds\[3\].*cannot be read") as e:
        enc.measure(rows[3])
    assert e.value.reason == "corrupt_image"


def test_image_bytes_obey_the_pixel_limit(data, monkeypatch) -> None:
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", Image.MAX_IMAGE_PIXELS)  # the limit is global
    rows = open_dataset("hf", str(data[0]))
    with pytest.raises(BadSampleError) as e:
        Encoder("qwen3_vl", max_image_pixels=96 * 64 - 1).measure(rows[1])
    assert e.value.reason == "image_too_large"


def test_parquet_and_pickled_rows(data, tmp_path) -> None:
    ds = datasets.load_from_disk(str(data[0])).select([0, 1, 4])
    ds.to_parquet(str(tmp_path / "part.parquet"))
    rows = open_dataset("hf", str(tmp_path / "part.parquet"))
    ref = open_dataset("hf", str(data[0]))
    assert [_content(r) for r in rows] == [_content(ref[n]) for n in (0, 1, 4)]
    again = pickle.loads(pickle.dumps(rows))  # what a DataLoader worker receives
    assert again[2] == rows[2] and list(again[1:]) == [rows[1], rows[2]]


def _seen(item) -> tuple:
    """(key, where, each turn's role and text; an image as "IMG") of a row."""
    return (item.key, item.where, [(m.role, ["IMG" if isinstance(c, ImageRef) else c
                                             for c in m.content]) for m in item.messages])


_P2 = ("p2", "ds[2]", [("user", ["IMG", "And here?"]), ("assistant", ["left"])])
_ROW3 = ("ds[3]", None, [("user", ["IMG", "Broken?"]), ("assistant", ["yes"])])
_TWO = ("two", "ds[4]", [("user", ["IMG", "IMG", "Both?"]), ("assistant", ["yes"])])


def test_a_slice_holds_its_own_rows(data, enc) -> None:
    """A slice (the held-out tail, a worker's share) reads its rows of the dataset, by index and
    in order, not the dataset's first rows."""
    from vlpack.data.loader import build_loaders

    rows = open_dataset("hf", str(data[0]))
    tail = rows[2:]
    assert len(tail) == 3
    assert [_seen(tail[i]) for i in range(3)] == [_P2, _ROW3, _TWO]
    assert [_seen(r) for r in tail] == [_P2, _ROW3, _TWO]  # iterating reads in chunks
    assert _seen(tail[-1]) == _TWO and _seen(rows[1:][1:3][0]) == _P2
    assert [r.key for r in rows[::2]] == ["t0", "p2", "two"]
    assert [r.key for r in list(rows[::2])] == ["t0", "p2", "two"]
    train, held_out = build_loaders(
        DataConfig(source="hf", path=str(data[0]), seq_len=512, max_bad_fraction=0.5,
                   eval_samples=2), enc, seed=0, pad_token_id=0, spatial_merge_size=2)
    assert [r.key for r in train.items] == ["t0", "ds[1]", "p2"]
    assert [_seen(r) for r in held_out.items] == [_ROW3, _TWO]


def test_loader_accounts_plans_and_resumes(data, enc) -> None:
    rows = open_dataset("hf", str(data[0]))
    jsonl = open_dataset("jsonl", str(data[1]))

    def loader(items, **kw):
        d = DataConfig(seq_len=512, buffer_size=4, overlong="skip", pad_to_multiple_of=1,
                       max_bad_fraction=1.0)
        return PackedLoader(items, enc, d, seed=1, pad_token_id=0, **kw)

    once = loader(rows, epochs=1)
    batches = list(once)
    assert once.accounting["packed"] == 4
    planned = once.stream.account.as_dict()  # the skip after the last bin rides on no bin
    assert planned["packed"] == 4 and planned["skipped"] == {"corrupt_image": 1}
    ids = sorted(int(t) for b in batches for t in b.input_ids.flatten().tolist())
    ref_ids = sorted(int(t) for b in loader(jsonl, epochs=1) for t in b.input_ids.flatten().tolist())
    assert ids == ref_ids  # the same tokens trained as from the JSONL twin
    straight = list(itertools.islice(iter(loader(rows, epochs=None)), 8))
    first = loader(rows, epochs=None)
    it = iter(first)
    for _ in range(3):
        next(it)
    resumed = loader(rows, epochs=None)
    resumed.load_state_dict(first.state_dict())
    for a, b in zip(straight[3:], itertools.islice(iter(resumed), 5), strict=True):
        assert a.sample_keys == b.sample_keys and torch.equal(a.input_ids, b.input_ids)


def test_image_paths_keep_the_media_root(data, enc, tmp_path, monkeypatch) -> None:
    """Images stored by path (a parquet written without embedding them): joined to the
    dataset's folder and bounded by the media root, as in JSONL."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "pq").mkdir()
    (tmp_path / "pq" / "upright.jpg").write_bytes((data[1].parent / "upright.jpg").read_bytes())
    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    msgs = [_turns("And here?", "left", True), _turns("Outside?", "no", True)]
    table = pa.table({"messages": msgs, "images": pa.array(
        [[{"bytes": None, "path": "upright.jpg"}], [{"bytes": None, "path": "../x/up.jpg"}]],
        pa.list_(image))})
    pq.write_table(table, tmp_path / "pq" / "paths.parquet")
    rows = open_dataset("hf", str(tmp_path / "pq" / "paths.parquet"))
    assert rows[0].images[0].data is None
    ref = open_dataset("jsonl", str(data[1]))[2]
    assert np.array_equal(enc.encode(rows[0]).pixel_values, enc.encode(ref).pixel_values)
    assert isinstance(rows[1], BadSampleError) and rows[1].reason == "media_outside_root"
    assert "paths.parquet[1]" in str(rows[1])
    wide = open_dataset("hf", DataFile.of(tmp_path / "pq" / "paths.parquet", tmp_path))
    assert isinstance(wide[1], Conversation)
    monkeypatch.chdir(tmp_path / "pq")  # a relative root, as a command line gives it
    for spelling in ("..", "../", "./../pq/.."):
        wide = open_dataset("hf", DataFile.of("paths.parquet", spelling))
        assert isinstance(wide[1], Conversation) and wide.file.root == tmp_path.resolve(), spelling


def test_dataset_dict_and_missing_path_name_the_fix(data, tmp_path) -> None:
    dd = datasets.DatasetDict({"train": datasets.load_from_disk(str(data[0]))})
    dd.save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ValueError, match=r"DatasetDict \(splits: train\).*dd/train"):
        open_dataset("hf", str(tmp_path / "dd"))
    with pytest.raises(ValueError, match="does not exist"):
        open_dataset("hf", str(tmp_path / "nope"))


def test_a_dataset_folder_reads_only_its_own_files(data, tmp_path) -> None:
    """A save_to_disk folder whose state.json names an Arrow file outside it (by `..` or an
    absolute path), or a folder of Arrow files holding a link out, is refused by name before
    anything is read: another dataset on the machine never enters training."""
    import shutil

    private = tmp_path / "private"
    datasets.Dataset.from_dict({"messages": [[{"role": "user", "content": "SECRET"}]]}
                               ).save_to_disk(str(private))
    arrow = next(private.glob("*.arrow"))
    shutil.copytree(private, tmp_path / "evil_x")  # beside evil/, its name extending evil's
    for name in (f"../private/{arrow.name}", str(arrow), f"../evil_x/{arrow.name}",
                 str(tmp_path / "evil_x" / arrow.name)):
        evil = tmp_path / "evil"
        shutil.rmtree(evil, ignore_errors=True)
        shutil.copytree(data[0], evil)
        state = json.loads((evil / "state.json").read_text())
        state["_data_files"] = [{"filename": name}]
        (evil / "state.json").write_text(json.dumps(state))
        with pytest.raises(ValueError, match=r"names the data file .* outside the folder"):
            open_dataset("hf", str(evil))
    files = tmp_path / "files"
    files.mkdir()
    shutil.copy(next(data[0].glob("*.arrow")), files / "a.arrow")
    assert len(open_dataset("hf", str(files))) == 5  # a folder of its own files reads
    (files / "b.arrow").symlink_to(arrow)
    with pytest.raises(ValueError, match=r"b\.arrow, which lies outside the folder"):
        open_dataset("hf", str(files))


def test_a_row_over_the_record_cap_is_refused_before_tokenizing(tmp_path, monkeypatch) -> None:
    """A row holds no more text than a JSONL record may (`MAX_RECORD_BYTES`): more is the bad
    sample `record_too_large`, named by row, and the rows after it still read."""
    from vlpack.data import hf_source

    monkeypatch.setattr(hf_source, "MAX_RECORD_BYTES", 1000)
    msgs = [[{"role": "user", "content": "q" * n}, {"role": "assistant", "content": "a"}]
            for n in (10, 2000, 20)]
    datasets.Dataset.from_dict({"messages": msgs}).save_to_disk(str(tmp_path / "ds"))
    rows = list(open_dataset("hf", str(tmp_path / "ds")))
    assert [getattr(r, "reason", None) for r in rows] == [None, "record_too_large", None]
    assert str(rows[1]).startswith("ds[1]: the row holds 2,014 characters of text")  # roles too


def test_build_loaders_reads_hf_and_a_mix_of_it(data, enc) -> None:
    from vlpack.config import DataConfig, MixSource
    from vlpack.data.loader import build_loaders

    kw = dict(seed=0, pad_token_id=0, spatial_merge_size=2)
    hf, _ = build_loaders(DataConfig(source="hf", path=str(data[0]), seq_len=512,
                                    max_bad_fraction=0.5), enc, **kw)
    assert len(hf.items) == 5 and next(iter(hf)).input_ids.numel() > 0
    mix = DataConfig(seq_len=512, max_bad_fraction=0.5, eval_samples=2,
                     mix=[MixSource(path=str(data[0]), weight=3),
                          MixSource(path=str(data[1]), weight=1)])
    train, held_out = build_loaders(mix, enc, **kw)
    assert held_out is None  # a mixture has no held-out tail: eval_samples is ignored
    assert len(train.items) == 9  # 5 rows + 4 lines, drawn 3:1
    assert [train.items.source_name(i) for i in range(9)].count("ds") == 7
    for _ in itertools.islice(iter(train), 4):
        pass
    assert set(train.accounting["sources"]) <= {"ds", "data.jsonl"}


# --- vlpack pack and data validate on a dataset ------------------------------------------------------
# `vlpack pack` and `vlpack data validate` read a Hugging Face dataset as they read JSONL: the same good
# samples as the dataset's JSONL twin, and the bad row named by its row.
pytest.importorskip("datasets")


def test_pack_reads_a_dataset_as_its_jsonl_twin(data, capsys) -> None:
    ds, jsonl = data
    reports = []
    for path in (ds, jsonl):
        assert main(["pack", str(path), "--seq-len", "2048", "--json"]) == 0
        reports.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    hf, twin = reports
    assert hf["samples"] == 5 and twin["samples"] == 4  # the twin holds the 4 good rows
    assert hf["packed"] == twin["packed"] == 4
    assert sum(hf["skipped"].values()) == 1 and "ds[3]" in hf["problems"][0]["message"]
    for k in ("bins", "efficiency", "vision_tokens_per_bin"):
        assert hf[k] == twin[k], k


def test_validate_reads_a_dataset(data, capsys) -> None:
    ds, _ = data
    assert main(["data", "validate", str(ds), "--workers", "1", "--json"]) == 1
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (r["samples"], r["good"]) == (5, 4)
    assert len(r["problems"]) == 1 and "ds[3]" in r["problems"][0]["message"]


# --- hub layouts: TRL's (llava-instruct-mix-vsft), ShareGPT/LLaVA columns, and a set to map first ----
_RED, _GREEN, _BLUE = (255, 0, 0), (0, 255, 0), (0, 0, 255)


def _colours(rows, n: int) -> tuple:
    """(each turn's role and content, an image as its colour) of row `n`, or its error's reason
    and message."""
    from vlpack.data.media import open_image

    item = rows[n]
    if isinstance(item, BadSampleError):
        return item.reason, str(item)
    return [(m.role, [open_image("k", c).getpixel((0, 0)) if isinstance(c, ImageRef) else c
                      for c in m.content]) for m in item.messages]


def _item(kind: str, text: str | None = None, index: int | None = None) -> dict:
    """A content item as TRL's datasets store it: both keys, the unused one null."""
    return {"type": kind, "index": index, "text": text}


def test_trl_layout_reads(tmp_path, enc) -> None:
    """llava-instruct-mix-vsft's layout: `messages` whose items all carry `index` and `text`
    (one null), and an `images` column of PIL images; an image item takes `images[index]`, or
    the next image when its index is null."""
    red, green, blue = (Image.new("RGB", (32, 32), c) for c in (_RED, _GREEN, _BLUE))
    T = _item
    rows = [  # (user content, images)
        ([T("image", index=0), T("text", "What colour?")], [red]),
        ([T("image", index=1), T("text", "and"), T("image", index=0)], [green, blue]),
        ([T("image"), T("text", "then"), T("image")], [green, blue]),
        ([T("text", "No picture.")], []),
        ([T("image", index=2), T("text", "Which?")], [red]),
        ([T("image", index=0), T("image", index=0)], [red, green]),
    ]
    msgs = [[{"role": "user", "content": c}, {"role": "assistant",
                                              "content": [T("text", f"answer {n}")]}]
            for n, (c, _) in enumerate(rows)]
    features = datasets.Features({
        "messages": datasets.List({"role": datasets.Value("string"), "content": datasets.List(
            {"index": datasets.Value("int64"), "text": datasets.Value("string"),
             "type": datasets.Value("string")})}),
        "images": datasets.List(datasets.Image())})  # fmt: skip
    datasets.Dataset.from_dict({"messages": msgs, "images": [r[1] for r in rows]},
                               features=features).save_to_disk(str(tmp_path / "vsft"))
    got = open_dataset("hf", str(tmp_path / "vsft"))
    assert _colours(got, 0) == [("user", [_RED, "What colour?"]), ("assistant", ["answer 0"])]
    assert _colours(got, 1) == [("user", [_BLUE, "and", _GREEN]), ("assistant", ["answer 1"])]
    assert _colours(got, 2) == [("user", [_GREEN, "then", _BLUE]), ("assistant", ["answer 2"])]
    assert _colours(got, 3) == [("user", ["No picture."]), ("assistant", ["answer 3"])]
    assert _colours(got, 4) == ("bad_schema", 'vsft[4]: image item 0 has "index": 2, but the '
                                'row holds 1 image(s) in "images": give each image item the '
                                '0-based position of its image in "images", or drop the index '
                                "to take them in order")
    assert _colours(got, 5) == ("bad_schema", "vsft[5]: the image items' \"index\" values "
                                "[0, 0] do not name each of the row's 2 image(s) in \"images\" "
                                "once: give one image item per image, indexed 0 to 1")
    sample = enc.encode(got[0])  # it trains: 32×32 is scaled up to the 128×128 min_pixels
    assert sample.image_grid_thw.tolist() == [[1, 8, 8]]


def test_trl_layout_videos_take_their_index(tmp_path) -> None:
    """Video items of TRL's layout take `videos[index]` too (here frame lists, never opened)."""
    T = _item
    msgs = [[{"role": "user", "content": [T("video", index=1), T("text", "or"),
                                          T("video", index=0)]},
             {"role": "assistant", "content": [T("text", "same")]}]]
    (tmp_path / "v").mkdir()
    datasets.Dataset.from_dict({"messages": msgs, "videos": [[["a0.png", "a1.png"],
                                                               ["b0.png", "b1.png"]]]}
                               ).to_parquet(str(tmp_path / "v" / "clips.parquet"))
    (row,) = open_dataset("hf", str(tmp_path / "v" / "clips.parquet"))
    first, text, second = row.messages[0].content
    assert [p.name for p in first.frames] == ["b0.png", "b1.png"] and text == "or"
    assert [p.name for p in second.frames] == ["a0.png", "a1.png"]


def test_sharegpt_columns_read(tmp_path) -> None:
    """`conversations` of `from`/`value` with `<image>` placeholders, and the images in an
    `image` column (one Image, or a path as LLaVA-Instruct gives it) or an `images` list."""
    red, green = (Image.new("RGB", (32, 32), c) for c in (_RED, _GREEN))
    conv = [[{"from": "human", "value": "<image>\nColour?"}, {"from": "gpt", "value": "Red."}],
            [{"from": "human", "value": "Colour?"}, {"from": "gpt", "value": "Green."}]]
    ds = datasets.Dataset.from_dict({"conversations": conv, "image": [red, green]},
                                    features=datasets.Features({
                                        "conversations": [{"from": datasets.Value("string"),
                                                           "value": datasets.Value("string")}],
                                        "image": datasets.Image()}))
    ds.save_to_disk(str(tmp_path / "one"))
    got = open_dataset("hf", str(tmp_path / "one"))
    assert _colours(got, 0) == [("user", [_RED, "\nColour?"]), ("assistant", ["Red."])]
    assert _colours(got, 1) == ("image_count_mismatch", 'one[1]: 0 <image> placeholder(s) but 1 '
                                'image(s) in "image"/"images": give exactly one image per '
                                "placeholder, in order")
    two = [[{"from": "human", "value": "<image><image>Same?"}, {"from": "gpt", "value": "No."}]]
    datasets.Dataset.from_dict({"conversations": two, "images": [[green, red]]}).cast_column(
        "images", datasets.List(datasets.Image())).save_to_disk(str(tmp_path / "many"))
    assert _colours(open_dataset("hf", str(tmp_path / "many")), 0) == [
        ("user", [_GREEN, _RED, "Same?"]), ("assistant", ["No."])]
    chat = [[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Q?"}]},
             {"role": "assistant", "content": [{"type": "text", "text": "A."}]}]]
    datasets.Dataset.from_dict({"conversations": chat, "images": [[red]]}).cast_column(
        "images", datasets.List(datasets.Image())).save_to_disk(str(tmp_path / "chat"))
    assert _colours(open_dataset("hf", str(tmp_path / "chat")), 0) == [  # role/content turns
        ("user", [_RED, "Q?"]), ("assistant", ["A."])]
    (tmp_path / "llava" / "coco").mkdir(parents=True)
    green.save(tmp_path / "llava" / "coco" / "0001.png")
    datasets.Dataset.from_dict({"id": ["0001"], "image": ["coco/0001.png"],
                                "conversations": conv[:1]}).to_parquet(
        str(tmp_path / "llava" / "train.parquet"))
    assert _colours(open_dataset("hf", str(tmp_path / "llava" / "train.parquet")), 0) == [
        ("user", [_GREEN, "\nColour?"]), ("assistant", ["Red."])]


def test_a_set_without_conversations_names_the_mapping(tmp_path) -> None:
    """A VQA set's columns (or The Cauldron's `texts`) are refused when opened, with the map
    that turns them into `messages`."""
    datasets.Dataset.from_dict({"image": [Image.new("RGB", (8, 8))], "question": ["Q?"],
                                "answer": ["A."]}).save_to_disk(str(tmp_path / "vqa"))
    with pytest.raises(ValueError, match=r'columns image, question, answer but no "messages" '
                       r'or "conversations" column: map each row .*ds\.map\(lambda r:'):
        open_dataset("hf", str(tmp_path / "vqa"))
