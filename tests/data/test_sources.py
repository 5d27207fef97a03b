"""JSONL sources: both record shapes, keys, paths, and one test per bad-input reason."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from vlpack.cli import main
from vlpack.config import DataConfig
from vlpack.data.encode import Encoder
from vlpack.data.loader import PackedLoader, open_dataset
from vlpack.data.media import DataFile
from vlpack.data.sources import iter_conversations, iter_jsonl, parse_record, read_jsonl
from vlpack.data.types import BadSampleError, Conversation, ImageRef, Message

BASE = Path("/data/set")


def _parse(obj, key="k"):
    # media_root "/": these tests are about record shapes; tests/data/test_media.py tests the root
    return parse_record(obj, file=DataFile(BASE / "d.jsonl", Path("/")), key=key)


def _reason(obj) -> str:
    with pytest.raises(BadSampleError) as info:
        _parse(obj)
    assert str(info.value).startswith("k: ")  # the message names the sample
    return info.value.reason


def test_messages_style_multi_image_with_system():
    conv = _parse({"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image", "image": "a.jpg"},
                                     {"type": "image", "image": "/abs/b.png"},
                                     {"type": "text", "text": "Compare."}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Same."}]},
        {"role": "user", "content": "Sure?"},
        {"role": "assistant", "content": "Yes."},
    ]})  # fmt: skip
    assert conv.messages == (
        Message("system", ("Be brief.",)),
        Message("user", (ImageRef(BASE / "a.jpg"), ImageRef(Path("/abs/b.png")), "Compare.")),
        Message("assistant", ("Same.",)),
        Message("user", ("Sure?",)),
        Message("assistant", ("Yes.",)),
    )
    assert conv.images == [ImageRef(BASE / "a.jpg"), ImageRef(Path("/abs/b.png"))]


def test_each_shape_reads_under_either_name():
    """Hub sets store `{"role", "content"}` turns under `conversations` and `{"from", "value"}`
    turns under `messages`: each reads by its shape, as it would under its own name."""
    conv = _parse({"conversations": [{"role": "user", "content": [
        {"type": "image", "image": "a.jpg"}, {"type": "text", "text": "Total?"}]},
        {"role": "assistant", "content": "12.50"}]})  # fmt: skip
    assert conv.messages == (Message("user", (ImageRef(BASE / "a.jpg"), "Total?")),
                             Message("assistant", ("12.50",)))
    conv = _parse({"messages": [{"from": "human", "value": "<image>Total?"},
                                {"from": "gpt", "value": "12.50"}], "image": "a.jpg"})
    assert conv.messages == (Message("user", (ImageRef(BASE / "a.jpg"), "Total?")),
                             Message("assistant", ("12.50",)))
    with pytest.raises(BadSampleError, match=r'k: "conversations" must be a list of \{"from", '
                       r'"value": str\} objects'):  # neither shape: the field's own error
        _parse({"conversations": [{"from": "human", "value": "Q"}, {"role": "assistant"}]})


def test_sharegpt_style_placeholders_in_order():
    conv = _parse({
        "conversations": [{"from": "system", "value": "Sys"},
                          {"from": "human", "value": "<image>\nFirst, then <image> second"},
                          {"from": "gpt", "value": "ok"}],
        "images": ["1.jpg", "2.jpg"]})  # fmt: skip
    assert conv.messages[1] == Message(
        "user", (ImageRef(BASE / "1.jpg"), "\nFirst, then ", ImageRef(BASE / "2.jpg"), " second")
    )
    single = _parse({"conversations": [{"from": "human", "value": "<image>Hi"},
                                       {"from": "gpt", "value": "ok"}], "image": "x.jpg"})  # fmt: skip
    assert single.images == [ImageRef(BASE / "x.jpg")]


def test_messages_style_with_top_level_images():
    conv = _parse({"messages": [{"role": "user", "content": "<image>Total?"},
                                {"role": "assistant", "content": "3"}], "images": ["r.jpg"]})  # fmt: skip
    assert conv.messages[0].content == (ImageRef(BASE / "r.jpg"), "Total?")


def test_same_conversation_in_both_shapes():
    messages = _parse({"messages": [
        {"role": "user", "content": [{"type": "image", "image": "r.jpg"},
                                     {"type": "text", "text": "Total?"}]},
        {"role": "assistant", "content": "3"}]})  # fmt: skip
    sharegpt = _parse({"conversations": [{"from": "human", "value": "<image>Total?"},
                                         {"from": "gpt", "value": "3"}], "image": "r.jpg"})  # fmt: skip
    assert messages == sharegpt


def test_text_only():
    conv = _parse({"messages": [{"role": "user", "content": "2+2?"},
                                {"role": "assistant", "content": "4"}]})  # fmt: skip
    assert conv.images == [] and len(conv.messages) == 2


def _write(path: Path, lines: list) -> Path:
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return path


GOOD = {"messages": [{"role": "user", "content": "<image>hi"},
                     {"role": "assistant", "content": "yo"}], "image": "img/a.jpg"}  # fmt: skip


def test_keys_and_relative_paths(tmp_path):
    path = _write(tmp_path / "d.jsonl", [GOOD, "", {**GOOD, "id": 7}])
    convs = read_jsonl(path)
    assert [c.key for c in convs] == ["d.jsonl:1", "7"]  # blank line 2 skipped, ids stringified
    assert convs[0].images[0].path == tmp_path.absolute() / "img" / "a.jpg"


def test_bad_records_do_not_stop_the_stream(tmp_path):
    path = _write(tmp_path / "d.jsonl", [
        GOOD, "{not json", {"messages": [{"role": "user", "content": "hi"}]}, GOOD, "[1, 2]",
        {"id": "x9", "messages": [{"role": "robot", "content": "hi"}]}])  # fmt: skip
    items = list(iter_jsonl(path))
    assert [type(i).__name__ for i in items] == ["Conversation", "BadSampleError",
                                                 "BadSampleError", "Conversation",
                                                 "BadSampleError", "BadSampleError"]  # fmt: skip
    assert "d.jsonl:2" in str(items[1]) and "one JSON object" in str(items[1])
    assert "x9" in str(items[5]) and "d.jsonl:6" in str(items[5])  # id and line both named
    skipped: Counter = Counter()
    good = list(iter_conversations(path, skipped))
    assert all(isinstance(c, Conversation) for c in good) and len(good) == 2
    assert skipped == {"bad_json": 1, "no_assistant_turn": 1, "bad_schema": 2}
    with pytest.raises(BadSampleError):
        read_jsonl(path)


def test_missing_file():
    with pytest.raises(ValueError, match="does not exist"):
        list(iter_jsonl("/no/such/file.jsonl"))


def test_bad_json(tmp_path):
    """A broken record names the column where JSON stops reading it; a record cut short at the
    line's end too (not column 1 of the line after)."""
    cut = '{"id": "cut", "messages": [{"role": "user"'
    items = list(iter_jsonl(_write(tmp_path / "d.jsonl", ['{"messages": [}', cut, GOOD])))
    assert [getattr(i, "reason", None) for i in items] == ["bad_json", "bad_json", None]
    assert "at column 15)" in str(items[0]) and f"at column {len(cut) + 1})" in str(items[1])


@pytest.mark.parametrize("images,text", [([], "<image>hi"), (["a.jpg"], "hi"),
                                         (["a.jpg"], "<image><image>hi")])  # fmt: skip
def test_image_count_mismatch(images, text):
    obj = {"conversations": [{"from": "human", "value": text}, {"from": "gpt", "value": "x"}],
           "images": images}  # fmt: skip
    assert _reason(obj) == "image_count_mismatch"


def test_no_assistant_turn():
    assert _reason({"messages": [{"role": "user", "content": "hi"}]}) == "no_assistant_turn"


@pytest.mark.parametrize("content", ["", "  \n", []])
def test_empty_assistant_turn(content):
    obj = {"messages": [{"role": "user", "content": "hi"},
                        {"role": "assistant", "content": content}]}  # fmt: skip
    assert _reason(obj) == "empty_assistant_turn"


@pytest.mark.parametrize("obj", [
    [1, 2],
    {"text": "no conversation here"},
    {"messages": "hi"},
    {"messages": [{"role": "robot", "content": "hi"}, {"role": "assistant", "content": "x"}]},
    {"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "x"}]},
    {"messages": [{"role": "user", "content": [{"type": "audio"}]},
                  {"role": "assistant", "content": "x"}]},
    {"messages": [{"role": "user", "content": [{"type": "image", "image": "http://x/a.jpg"}]},
                  {"role": "assistant", "content": "x"}]},
    {"conversations": [{"from": "bot", "value": "x"}]},
    {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "x"},
                       {"from": "system", "value": "late system"}]},
    {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "<image>x"}],
     "image": "a.jpg"},
    {"messages": [{"role": "user", "content": "see <|image_pad|>"},
                  {"role": "assistant", "content": "x"}]},
    {"messages": [{"role": "system", "content": "s"}, {"role": "assistant", "content": "x"}]},
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}],
     "images": [3]},
])  # fmt: skip
def test_bad_schema(obj):
    assert _reason(obj) == "bad_schema"


def test_not_utf8_and_bom(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(GOOD).encode() + b"\n\xff\xfe{}\n")
    first, second = iter_jsonl(path)
    assert isinstance(first, Conversation)
    assert isinstance(second, BadSampleError) and second.reason == "bad_json"


@pytest.mark.parametrize(("roles", "why"), [
    (("assistant", "user", "assistant"), "starts with an assistant turn"),
    (("system", "assistant", "user", "assistant"), "starts with an assistant turn"),
    (("user", "assistant", "user"), "ends with a user turn"),
    (("system", "user", "assistant", "user"), "ends with a user turn")])
def test_a_conversation_runs_from_a_user_turn_to_an_answer(roles, why) -> None:
    obj = {"messages": [{"role": r, "content": f"{r} {i}"} for i, r in enumerate(roles)]}
    with pytest.raises(BadSampleError, match=why) as info:
        _parse(obj)
    assert info.value.reason == "bad_schema"
    ok = {"messages": [{"role": r, "content": r} for r in ("system", "user", "user", "assistant")]}
    assert [m.role for m in _parse(ok).messages] == ["system", "user", "user", "assistant"]


# --- text that is not Unicode ------------------------------------------------------------------------
# Text that is not Unicode: a lone surrogate (`"\ud800"`) in a JSON line is a bad sample named by
# file:line in `pack`, `data validate` and training, and the other bad samples are still reported.
def _turns(user: str, answer: str | None = "ok") -> str:
    msgs = [{"role": "user", "content": user}]
    if answer is not None:
        msgs.append({"role": "assistant", "content": answer})
    return json.dumps({"messages": msgs})


@pytest.fixture
def data(tmp_path: Path) -> Path:
    lines = [_turns("first"), _turns("half a pair: \\ud800 here"), _turns("no answer", None),
             _turns("last")]  # json.dumps escapes the backslash: undo it for line 2's escape
    lines[1] = lines[1].replace("\\\\ud800", "\\ud800")
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(lines) + "\n")
    assert "\ud800" in json.loads(path.read_text().splitlines()[1])["messages"][0]["content"]
    return path


def test_pack_counts_it(data: Path, capsys) -> None:
    assert main(["pack", str(data), "--seq-len", "512", "--json"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["skipped"] == {"bad_json": 1, "no_assistant_turn": 1} and r["packed"] == 2


def test_validate_names_it_and_every_other_bad_sample(data: Path, capsys) -> None:
    assert main(["data", "validate", str(data), "--workers", "1"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"bad_json: {data}:2: text holds a lone surrogate (\\ud800")
    assert out[1].startswith("no_assistant_turn: d.jsonl:3: ")
    assert out[-1].startswith("4 samples: 2 good, 2 bad")


def test_training_counts_it_as_a_bad_sample(data: Path) -> None:
    enc = Encoder("qwen3_vl")
    d = DataConfig(seq_len=512, shuffle=False, max_bad_fraction=1.0, pad_to_multiple_of=1)
    loader = PackedLoader(open_dataset("jsonl", str(data)), enc, d, seed=0, epochs=1,
                          pad_token_id=0)
    keys = [k for row in loader for k in row.sample_keys]
    assert sorted(keys) == ["d.jsonl:1", "d.jsonl:4"]
    assert loader.accounting["skipped"] == {"bad_json": 1, "no_assistant_turn": 1}


def test_a_record_from_a_shard_is_refused_too(tmp_path: Path) -> None:
    """The Energon task encoder parses records itself (no JSONL line to check)."""
    record = json.loads(_turns("x \\ud800").replace("\\\\ud800", "\\ud800"))
    with pytest.raises(BadSampleError, match="lone surrogate") as info:
        parse_record(record, file=DataFile(tmp_path), key="s\udc00k")
    assert info.value.reason == "bad_json"
    str(info.value).encode("utf-8")  # the message itself can be printed


# One hostile line: a record nested beyond any conversation, or larger than any record needs, is a
# bad sample named by its line; the lines after it still train, and a huge line is never held.
def test_deep_nesting_is_a_bad_sample_and_the_next_line_still_reads(tmp_path: Path) -> None:
    deep = '{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}"  # past json's recursion limit
    nested = json.loads(_turns("q"))
    nested["tools"] = [{"a": None}]
    inner = nested["tools"][0]
    for _ in range(70):  # parses, but deeper than MAX_DEPTH
        inner["a"] = {"a": None}
        inner = inner["a"]
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join([deep, json.dumps(nested), _turns("fine")]) + "\n")
    items = list(iter_jsonl(path))
    assert [getattr(i, "reason", None) for i in items] == ["bad_json", "bad_json", None]
    assert str(items[0]).startswith(f"{path}:1: not valid UTF-8 JSON (values nested too deeply")
    assert str(items[1]).startswith(f"{path}:2: values nested more than 64 deep")
    assert [getattr(i, "reason", None) for i in open_dataset("jsonl", str(path))] == [
        "bad_json", "bad_json", None]


def test_json_that_python_refuses_inside_the_record_is_a_bad_sample(tmp_path: Path) -> None:
    """JSON that parses, or not, only past Python's own limits is a bad sample named by its
    line, and the next line still reads: an integer of 5,000 digits in the record or in a call's
    arguments string, JSON nested 100,000 deep or a lone surrogate inside the `tools` string, an
    arguments string or a ShareGPT function_call value, and reasoning that holds a reserved
    vision token."""
    deep = "[" * 100_000 + "]" * 100_000

    def with_call(args) -> str:
        return json.dumps({"messages": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "f", "arguments": args}}]},
            {"role": "tool", "content": "r"}, {"role": "assistant", "content": "a"}]})

    tools = json.loads(_turns("q"))
    sharegpt = {"conversations": [{"from": "human", "value": "q"},
                                  {"from": "function_call", "value": deep},
                                  {"from": "observation", "value": "r"},
                                  {"from": "gpt", "value": "a"}]}
    reasoning = {"messages": [{"role": "user", "content": "q"}, {
        "role": "assistant", "content": "a", "reasoning_content": "see <|image_pad|>"}]}
    lines = [
        _turns("q")[:-1] + ', "n": ' + "1" * 5000 + "}",
        with_call('{"n": ' + "1" * 5000 + "}"),
        json.dumps({**tools, "tools": deep}),
        with_call('{"a": "\\ud800"}'),
        json.dumps({**tools, "tools": '[{"name": "f", "description": "\\ud800"}]'}),
        json.dumps(sharegpt),
        json.dumps(reasoning),
        _turns("fine"),
    ]
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(lines) + "\n")
    items = list(iter_jsonl(path))
    assert [getattr(i, "reason", None) for i in items] == [
        "bad_json", "bad_tool_call", "bad_tools", "bad_tool_call", "bad_tools", "bad_tool_call",
        "bad_schema", None]
    assert "Exceeds the limit (4300 digits)" in str(items[0])
    assert "nested too deeply" in str(items[2]) and "lone surrogate" in str(items[3])
    assert all(f"[{path}:{n}]" in str(items[n - 1]) or str(items[n - 1]).startswith(f"{path}:{n}")
               or str(items[n - 1]).startswith(f"{path.name}:{n}") for n in range(1, 8)), items


def test_a_record_names_at_most_max_visual_items(tmp_path: Path) -> None:
    """MAX_VISUAL_ITEMS images and videos in a record read; one more (as top-level images,
    content items or videos) is the bad sample `too_many_visuals`, before any path is read."""
    from vlpack.data.sources import MAX_VISUAL_ITEMS

    n = MAX_VISUAL_ITEMS
    ok = {"conversations": [{"from": "human", "value": "<image>" * n + "q"},
                            {"from": "gpt", "value": "a"}], "images": ["a.png"] * n}
    assert len(parse_record(ok, file=DataFile(tmp_path), key="k").images) == n
    over = [dict(ok, images=["a.png"] * (n + 1)),
            {"messages": [{"role": "user", "content": [{"type": "image", "image": "a.png"}] * n
                           + [{"type": "video", "video": "v.mp4"}]},
                          {"role": "assistant", "content": "a"}]},
            dict(ok, videos=["v.mp4"])]
    for record in over:
        with pytest.raises(BadSampleError, match=f"names {n + 1:,} images and videos") as e:
            parse_record(record, file=DataFile(tmp_path / "nowhere"), key="k")
        assert e.value.reason == "too_many_visuals"


def test_a_record_over_the_size_cap_is_skipped_unread(tmp_path: Path) -> None:
    from vlpack.data.sources import MAX_RECORD_BYTES

    big = _turns("x" * (MAX_RECORD_BYTES + 10))
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join([_turns("first"), big, _turns("last")]) + "\n")
    for items in (list(iter_jsonl(path)), list(open_dataset("jsonl", str(path)))):
        assert [getattr(i, "reason", None) for i in items] == [None, "record_too_large", None]
        assert str(items[1]) == (f"{path}:2: the record is {len(big) + 1:,} bytes, over 8 MiB: "
                                 "split the conversation into several records, or drop the line")
    rows = open_dataset("jsonl", str(path))
    assert isinstance(rows[1], BadSampleError) and rows[2].messages[0].content == ("last",)


def test_a_data_file_in_the_home_folder_warns_that_all_of_it_is_readable(
        tmp_path: Path, monkeypatch, caplog) -> None:
    """The default media root is the data file's folder: in the home folder (or /) that is every
    file the user has, so vlpack says so and how to narrow it."""
    monkeypatch.setenv("HOME", str(tmp_path))
    caplog.set_level("WARNING", logger="vlpack.data")
    (tmp_path / "sub").mkdir()
    for where in (tmp_path / "sub", tmp_path):
        open_dataset("jsonl", str(_write(where / "d.jsonl", [_turns("hi")])))
    (record,) = caplog.records
    assert record.getMessage().startswith(f"media paths may name any file under {tmp_path} ")
    assert "data.media_root" in record.getMessage()
    open_dataset("jsonl", DataFile.of(str(tmp_path / "d.jsonl"), str(tmp_path / "sub")))
    assert len(caplog.records) == 1  # a narrower root given: no warning
