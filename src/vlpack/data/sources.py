"""Read JSONL conversations into `Conversation`s.

Two record shapes are accepted (one JSON object per line), each under either name: turns of
`{"role", "content"}` read as messages style and turns of `{"from", "value"}` as ShareGPT, under
`messages` or `conversations` alike:

messages style::

    {"id": "a1", "messages": [
        {"role": "system", "content": "You read receipts."},
        {"role": "user", "content": [{"type": "image", "image": "images/0.jpg"},
                                     {"type": "text", "text": "Total?"}]},
        {"role": "assistant", "content": "12.50"}]}

ShareGPT / LLaVA style::

    {"conversations": [{"from": "human", "value": "<image>\\nTotal?"},
                       {"from": "gpt", "value": "12.50"}],
     "image": "images/0.jpg"}          # or "images": [...]

Each `<image>` placeholder in a string consumes the next entry of the record's `image`/`images`
(messages-style string contents may use placeholders too); text around it is kept verbatim.

Videos: a messages-style item `{"type": "video", "video": "clip.mp4", "fps": 2}` (a container
file; `fps`, optional, overrides the rate its header gives) or `{"type": "video", "video":
["f0.jpg", "f1.jpg", ...], "fps": 2}` (frame images: a video sampled at `fps`, default 2); in
ShareGPT records each `<video>` placeholder consumes the next entry of `video`/`videos` (a file
path or a list of frame paths). Images and videos mix freely in user turns.

Paths are relative to the JSONL file's folder unless absolute, and must resolve inside the media
root (`data.media_root`, by default the JSONL file's folder; `vlpack.data.media` gives the policy
and its reason, and its `DataFile` carries a file with its root to every reader here): one that
escapes is refused here, by name. Files are not opened here: a missing
or corrupt one is reported when the sample is encoded or measured.

Agent and tool-call data (`vlpack.data.tools` renders it per family)::

    {"tools": [{"type": "function", "function": {"name": "get_weather", "description": "...",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}],
     "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather",
                                              "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "18 C, sunny"},
        {"role": "assistant", "content": "18 C and sunny.", "loss": true}]}

`tools` is a list of JSON function schemas (or a string holding one, as some ShareGPT exports
store it); a call's `arguments` is a JSON object (or a string holding one, OpenAI's form, parsed
here). `"loss": false` on an assistant message (or a ShareGPT turn) masks that turn's labels; tool
results, user and system turns are never supervised. In ShareGPT records a `function_call` turn
(its value a call or a list of calls, as JSON) is an assistant turn that calls, and an
`observation` (or `tool`) turn is a tool result. A tool result must follow the assistant turn
that calls the tool (or another result).

The key of a sample is its `id` field, else `<file name>:<line>` (1-based).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from vlpack.data.media import DataFile
from vlpack.data.types import BadSampleError, Conversation, ImageRef, Message, ToolCall, VideoRef

log = logging.getLogger(__name__)

IMAGE_PLACEHOLDER = "<image>"
VIDEO_PLACEHOLDER = "<video>"
ROLES = {"system": "system", "user": "user", "human": "user", "assistant": "assistant",
         "gpt": "assistant", "tool": "tool", "observation": "tool",
         "function_call": "assistant"}  # fmt: skip
MAX_RECORD_BYTES = 8 * 2**20
"""The largest JSONL record (line) read: 8 MiB of text is about two million tokens, far beyond
any `data.seq_len`; a longer line is skipped unread as `record_too_large`."""
MAX_DEPTH = 64
"""The deepest nesting of a record's JSON values (a conversation with tool calls needs under
ten levels)."""
MAX_VISUAL_ITEMS = 1024
"""Images and videos (a video counts once, whatever its frames) one record may name: a sample
holds its items' tokens and pixels at once, so a short line naming one image thousands of times
would take gigabytes to measure."""
MIN_FPS, MAX_FPS = 1e-3, 1e3
"""The frame rates a record may give a video: a rate outside them (`Infinity` and `1e-308` are
JSON numbers to Python) would make its MRoPE time positions overflow or collapse."""
RESERVED = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
"""Strings that would turn into vision tokens if they appeared in text."""


def iter_jsonl(file: DataFile | str | Path) -> Iterator[Conversation | BadSampleError]:
    """Stream the records of a JSONL file: a `Conversation` per good record, the
    `BadSampleError` (not raised) per bad one, so a loader can skip and count by `reason`.
    Media paths must resolve inside the file's media root (a bare path: its folder)."""
    return (item for _, item in iter_jsonl_lines(file))


def iter_jsonl_lines(
    file: DataFile | str | Path,
) -> Iterator[tuple[bytes | None, Conversation | BadSampleError]]:
    """`iter_jsonl`'s records, each with its line's bytes (None for a line over
    `MAX_RECORD_BYTES`, which is never held): one definition of a record and a blank line for
    every reader of a JSONL file."""
    file = DataFile.of(file)
    path = file.path
    check_jsonl_path(path)
    with path.open("rb") as f:
        lineno = 0
        while raw := f.readline(MAX_RECORD_BYTES + 1):
            lineno += 1
            if len(raw) > MAX_RECORD_BYTES and not raw.endswith(b"\n"):
                size = len(raw)
                while (rest := f.readline(2**20)) and not rest.endswith(b"\n"):
                    size += len(rest)  # the rest of the line, a MiB at a time, never held
                yield None, too_large(path, lineno, size + len(rest))
            elif raw.strip():
                yield raw, parse_line(raw, file, lineno)


def too_large(path: Path, lineno: int, size: int) -> BadSampleError:
    """The error of line `lineno`, `size` bytes long: over `MAX_RECORD_BYTES`."""
    return BadSampleError(
        "record_too_large",
        f"{path}:{lineno}: the record is {size:,} bytes, over {MAX_RECORD_BYTES // 2**20} MiB: "
        "split the conversation into several records, or drop the line",
    )


def source_kind(path: str | Path) -> str:
    """`hf` for a Hugging Face dataset (a folder holding one, or a .parquet/.arrow file),
    `jsonl` for anything else (a JSONL file; a missing path or a folder of JSONL files get
    the JSONL reader's error)."""
    p = Path(path)
    if p.suffix in (".parquet", ".arrow"):
        return "hf"
    if p.is_dir() and any(p.glob("*.jsonl")) and not (p / "state.json").is_file():
        return "jsonl"
    return "hf" if p.is_dir() else "jsonl"


def check_jsonl_path(path: Path) -> None:
    """ValueError naming the fix when `path` is a folder or missing (not a JSONL file)."""
    if path.is_dir():
        inside = sorted(p.name for p in path.glob("*.jsonl"))[:5]
        hint = (f" (it holds {', '.join(inside)})" if inside
                else " (an Energon dataset folder trains with data.source=energon)")
        raise ValueError(f"data file {path} is a folder{hint}: pass the path of a .jsonl file")
    if not path.is_file():
        raise ValueError(f"data file {path} does not exist: pass the path of a .jsonl file")


def parse_line(raw: bytes, file: DataFile, lineno: int) -> Conversation | BadSampleError:
    """The record on line `lineno` (1-based) of the JSONL file `file`: its `Conversation`, or
    the `BadSampleError` (returned, not raised) that names the line and the fix."""
    path = file.path
    where = f"{path.name}:{lineno}"
    if len(raw) > MAX_RECORD_BYTES:
        return too_large(path, lineno, len(raw))
    try:
        # the line's end off: else a record cut short is refused at "column 1" of the next line
        obj = json.loads(raw.rstrip(b"\r\n").decode("utf-8-sig" if lineno == 1 else "utf-8"))
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, too many digits
        detail = _json_error(e)
        return BadSampleError(
            "bad_json",
            f"{path}:{lineno}: not valid UTF-8 JSON ({detail}); each line must hold one JSON "
            "object",
        )
    if (bad := _unusable(obj)) is not None:
        return BadSampleError("bad_json", f"{path}:{lineno}: {bad}")
    has_id = isinstance(obj, dict) and obj.get("id") not in (None, "")
    key = str(obj["id"]) if has_id else where
    try:
        conv = parse_record(obj, file=file, key=key)
        return conv if key == where else dataclasses.replace(conv, where=where)
    except BadSampleError as e:
        if key != where:  # name the line too, so the record can be found
            e.args = (f"{e} [{path}:{lineno}]",)
        return e


def iter_conversations(
    file: DataFile | str | Path, skipped: Counter[str] | None = None
) -> Iterator[Conversation]:
    """The good conversations of a JSONL file; bad records are logged and counted by reason
    into `skipped` when given."""
    for item in iter_jsonl(file):
        if isinstance(item, BadSampleError):
            log.warning("skipping sample: %s", item)
            if skipped is not None:
                skipped[item.reason] += 1
            continue
        yield item


def read_jsonl(file: DataFile | str | Path) -> list[Conversation]:
    """All conversations of a JSONL file; raises the first `BadSampleError`."""
    out = []
    for item in iter_jsonl(file):
        if isinstance(item, BadSampleError):
            raise item
        out.append(item)
    return out


def parse_record(
    obj: Any, *, file: DataFile, key: str, images: list[ImageRef] | None = None,
) -> Conversation:
    """Turn one decoded JSON record of `file` into a `Conversation`; raises `BadSampleError`
    whose message names `key`, the problem and the fix. Media paths are joined to the file's
    folder and must resolve inside its root (`DataFile.media`). `images`, when given, are the record's
    top-level images already read (a Hugging Face dataset's `Image` column, `hf_source.py`)
    in place of its `image`/`images` paths."""
    if (bad := _unusable(obj)) is not None:  # records that did not come through iter_jsonl
        _bad(key.encode("utf-8", "backslashreplace").decode(), "bad_json", bad)
    if not isinstance(obj, dict):
        _bad(key, "bad_schema", f"a record must be a JSON object, got {type(obj).__name__}")
    paths = _record_images(obj, key) if images is None else []
    tools = _tools(obj.get("tools"), key)
    if "messages" in obj or "conversations" in obj:
        field = "messages" if "messages" in obj else "conversations"
        raw = _turns(obj[field], key, field)
    else:
        _bad(key, "bad_schema", 'a record needs a "messages" or a "conversations" list')
    n_items = len(paths if images is None else images) + len(_record_videos(obj, key)) + sum(
        not isinstance(part, str) for turn in raw for part in turn.parts)
    if n_items > MAX_VISUAL_ITEMS:  # before a path is resolved or an array sized
        _bad(key, "too_many_visuals", f"the record names {n_items:,} images and videos, over "
             f"the {MAX_VISUAL_ITEMS:,} a sample may hold: split it into several records")

    def join(p: str, what: str = "image") -> Path:
        return file.media(p, key, what)

    videos = [_video_ref(v, None, join, key) for v in _record_videos(obj, key)]
    refs = [ImageRef(path=join(p)) for p in paths] if images is None else list(images)
    queues = {IMAGE_PLACEHOLDER: list(refs), VIDEO_PLACEHOLDER: videos}
    for placeholder, items, what, field in (
            (IMAGE_PLACEHOLDER, refs, "image", '"image"/"images"'),
            (VIDEO_PLACEHOLDER, videos, "video", '"video"/"videos"')):
        n = sum(part.count(placeholder) for turn in raw for part in turn.parts
                if isinstance(part, str))
        if n != len(items):
            _bad(key, f"{what}_count_mismatch",
                 f"{n} {placeholder} placeholder(s) but {len(items)} {what}(s) in {field}: give "
                 f"exactly one {what} per placeholder, in order")
    messages = []
    for turn in raw:
        content: list[str | ImageRef | VideoRef] = []
        for part in turn.parts:
            if isinstance(part, str):
                content.extend(_split_placeholders(part, queues))
            elif isinstance(part, _RawVideo):
                content.append(_video_ref(part.video, part.fps, join, key))
            else:
                content.append(ImageRef(path=join(str(part))))
        messages.append(Message(role=turn.role, content=tuple(content), tool_calls=turn.calls,
                                loss=turn.loss, reasoning=turn.reasoning))
    conv = Conversation(key=key, messages=tuple(messages), tools=tools)
    _validate(conv)
    return conv


def _json_error(e: Exception) -> str:
    """What `json.loads` refused, in a few words."""
    if isinstance(e, json.JSONDecodeError):
        return f"{e.msg} at column {e.colno}"
    if isinstance(e, RecursionError):
        return "values nested too deeply to parse"
    return str(e)  # bad UTF-8; an integer of more digits than Python converts


def _nested_json(text: str, key: str, reason: str, what: str, fix: str = "") -> Any:
    """A JSON value held in a string field of the record (`tools`, a call's arguments),
    parsed and held to the record's own limits (`_unusable`); else BadSampleError `reason`
    naming `what`."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as e:
        _bad(key, reason, f"{what} is not usable JSON ({_json_error(e)}){fix}")
    if (bad := _unusable(value)) is not None:
        _bad(key, reason, f"{what}: {bad}{fix}")
    return value


def _unusable(obj: Any) -> str | None:
    """Why `obj` (decoded JSON) is not usable text, or None: a string (or key) holding a lone
    surrogate, which JSON's `\\ud800` escapes allow but no tokenizer or file system takes, or
    values nested deeper than `MAX_DEPTH`."""
    stack = [(obj, 0)]
    while stack:
        x, depth = stack.pop()
        if depth > MAX_DEPTH:
            return (f"values nested more than {MAX_DEPTH} deep (a conversation needs a few "
                    "levels): flatten the record or drop the line")
        if isinstance(x, dict):
            stack.extend((k, depth + 1) for k in x.keys())
            stack.extend((v, depth + 1) for v in x.values())
        elif isinstance(x, list):
            stack.extend((v, depth + 1) for v in x)
        elif isinstance(x, str):
            try:
                x.encode("utf-8")
            except UnicodeEncodeError as e:
                code = ord(x[e.start])
                return (f"text holds a lone surrogate (\\u{code:04x}, half of a UTF-16 pair), "
                        f"which is not Unicode text: near {x[max(e.start - 20, 0):e.start]!r}; "
                        "write the character itself or its full pair of escapes, or drop the "
                        "line")
    return None


@dataclass(frozen=True)
class _RawVideo:
    """A messages-style video item as given: a path or a list of frame paths, and its fps."""

    video: Any
    fps: Any


@dataclass(frozen=True)
class _Turn:
    """A turn as given: its role, its parts (text, an image path not yet joined, or a video),
    its tool calls and whether it is supervised."""

    role: str
    parts: list[str | Path | _RawVideo]
    calls: tuple[ToolCall, ...] = ()
    loss: bool = True
    reasoning: str | None = None


_Turns = list[_Turn]


def _bad(key: str, reason: str, message: str) -> NoReturn:
    raise BadSampleError(reason, f"{key}: {message}")


def _one_of(obj: dict, key: str, one: str, many: str) -> None:
    """A record names its media under `one` or `many`, not both (which would be ambiguous)."""
    if one in obj and many in obj:
        _bad(key, "bad_schema", f'the record has both "{one}" and "{many}": keep one of them')


def _record_images(obj: dict, key: str) -> list[str]:
    _one_of(obj, key, "image", "images")
    images = obj.get("images", obj.get("image", []))
    if images is None:
        return []
    if isinstance(images, str):
        images = [images]
    if not isinstance(images, list) or not all(isinstance(p, str) and p for p in images):
        _bad(key, "bad_schema", '"image" must be a path and "images" a list of paths')
    return images


def _record_videos(obj: dict, key: str) -> list:
    _one_of(obj, key, "video", "videos")
    videos = obj.get("videos", obj.get("video", []))
    if videos is None:
        return []
    if isinstance(videos, str):
        return [videos]
    if not isinstance(videos, list):
        _bad(key, "bad_schema", '"video" must be a path or a frame list, "videos" a list of them')
    if videos and all(isinstance(v, str) for v in videos) and "video" in obj \
            and "videos" not in obj:
        return [videos]  # "video": [frames...] is one video given as frames
    return videos


def _video_ref(video: Any, fps: Any, join: Callable[[str, str], Path], key: str) -> VideoRef:
    """A VideoRef from a path or a frame list (each joined by `join`) and an optional fps."""
    if fps is not None and (isinstance(fps, bool) or not isinstance(fps, int | float)
                            or not MIN_FPS <= fps <= MAX_FPS):  # also NaN and Infinity
        _bad(key, "bad_schema", f"video fps must be a number from {MIN_FPS:g} to {MAX_FPS:g} "
             f"(frames per second), got {fps!r:.40}")
    fps = None if fps is None else float(fps)
    if isinstance(video, str) and video:
        if "://" in video:
            _bad(key, "bad_schema", f"video {video!r} is a URL: download it and give a path")
        return VideoRef(path=join(video, "video"), fps=fps)
    if isinstance(video, list) and video and all(isinstance(p, str) and p for p in video):
        return VideoRef(frames=tuple(join(p, "video frame") for p in video), fps=fps)
    _bad(key, "bad_schema", f"a video must be a file path or a non-empty list of frame paths, "
         f"got {video!r:.80}")


def _role(value: Any, key: str, field: str) -> str:
    if not isinstance(value, str) or value not in ROLES or (field == "role" and
                                                             value == "function_call"):
        _bad(key, "bad_schema", f"unknown {field} {value!r}: use one of system, user/human, "
             "assistant/gpt, tool/observation" + (", function_call" if field != "role" else ""))
    return ROLES[value]


def _loss(turn: dict, role: str, key: str, i: int) -> bool:
    """A turn's `loss` flag: a bool, and never true on a turn that is not the assistant's."""
    loss = turn.get("loss", True)
    if not isinstance(loss, bool):
        _bad(key, "bad_schema", f'turn {i}: "loss" must be true or false, got {loss!r}')
    if loss and "loss" in turn and role != "assistant":
        _bad(key, "bad_schema", f'turn {i} is a {role} turn with "loss": true, but only '
             "assistant turns are trained (tool results, user and system turns never are): "
             'drop the key')
    return loss if role == "assistant" else True  # the flag only masks answers


def _reasoning(turn: dict, role: str, key: str, i: int) -> str | None:
    """A messages-style turn's `reasoning_content`: text, on an assistant turn only."""
    reasoning = turn.get("reasoning_content")
    if reasoning is not None and (role != "assistant" or not isinstance(reasoning, str)):
        _bad(key, "bad_schema", f'turn {i}: "reasoning_content" must be the text of an '
             f"assistant turn's reasoning, got {reasoning!r:.60} on a {role} turn")
    return reasoning


def _tools(tools: Any, key: str) -> tuple[dict, ...]:
    """The record's `tools`: a list of function schemas, or a string holding that list as JSON."""
    fix = ('; a tool is {"type": "function", "function": {"name": NAME, "description": TEXT, '
           '"parameters": JSON-SCHEMA-OBJECT}}')
    if tools is None:
        return ()
    if isinstance(tools, str):
        tools = _nested_json(tools, key, "bad_tools", '"tools" (a string)', fix)
    if not isinstance(tools, list):
        _bad(key, "bad_tools", f'"tools" must be a list of function schemas, got '
             f"{type(tools).__name__}{fix}")
    for j, tool in enumerate(tools):
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            _bad(key, "bad_tools", f"tools[{j}] has no function name: {tool!r:.80}{fix}")
        params = fn.get("parameters")
        if params is not None and (not isinstance(params, dict) or not isinstance(
                params.get("properties", {}), dict)):
            _bad(key, "bad_tools", f"tools[{j}] ({fn['name']}): \"parameters\" must be a JSON "
                 f"schema object with a \"properties\" object, got {params!r:.80}{fix}")
        if not isinstance(fn.get("description", ""), str):
            _bad(key, "bad_tools", f"tools[{j}] ({fn['name']}): \"description\" must be text"
                 f"{fix}")
    return tuple(tools)


def _tool_calls(calls: Any, key: str, i: int) -> tuple[ToolCall, ...]:
    """The tool calls of turn `i`: a list (or one call) of `{"type": "function", "function":
    {"name", "arguments"}}` or `{"name", "arguments"}`; `arguments` an object or a JSON string
    holding one."""
    fix = ('; a call is {"type": "function", "function": {"name": NAME, "arguments": '
           '{...}}}')
    if isinstance(calls, dict):
        calls = [calls]
    if not isinstance(calls, list) or not calls:
        _bad(key, "bad_tool_call", f"turn {i}: tool calls must be a non-empty list, got "
             f"{calls!r:.80}{fix}")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            _bad(key, "bad_tool_call", f"turn {i}, call {j} has no function name: "
                 f"{call!r:.80}{fix}")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            args = _nested_json(args, key, "bad_tool_call",
                                f"turn {i}, call {j} ({fn['name']}): its arguments string", fix)
        if not isinstance(args, dict):
            _bad(key, "bad_tool_call", f"turn {i}, call {j} ({fn['name']}): arguments must be "
                 f"a JSON object, got {args!r:.80}{fix}")
        out.append(ToolCall(fn["name"], args))
    return tuple(out)


def _turns(turns: Any, key: str, field: str) -> _Turns:
    """The turns under `field`, read by their shape: `{"role", "content"}` turns as messages,
    `{"from", "value"}` turns as ShareGPT, whichever of the two names holds them (hub datasets
    use both names for both shapes); a list of neither shape gets the error of `field`'s own
    shape."""
    def has(name: str) -> bool:
        return isinstance(turns, list) and bool(turns) and all(
            isinstance(t, dict) and name in t for t in turns)

    if has("from") and not has("role"):
        return _sharegpt_turns(turns, key)
    if has("role") and not has("from"):
        return _messages_turns(turns, key)
    return (_messages_turns if field == "messages" else _sharegpt_turns)(turns, key)


def _messages_turns(messages: Any, key: str) -> _Turns:
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        _bad(key, "bad_schema", '"messages" must be a list of {"role", "content"} objects')
    turns: _Turns = []
    for i, m in enumerate(messages):
        role = _role(m.get("role"), key, "role")
        content = m.get("content")
        calls = ()
        if m.get("tool_calls") is not None:
            if role != "assistant":
                _bad(key, "bad_tool_call", f"turn {i}: a {role} turn has tool_calls; only "
                     "assistant turns call tools")
            calls = _tool_calls(m["tool_calls"], key, i)
        if content is None and calls:
            parts = []
        elif isinstance(content, str):
            parts = [content]
        elif isinstance(content, list):
            parts = [_content_item(item, key) for item in content]
        else:
            _bad(key, "bad_schema", f"a {role} message needs a string or list content")
        turns.append(_Turn(role, parts, calls, _loss(m, role, key, i), _reasoning(m, role, key, i)))
    return turns


def _content_item(item: Any, key: str) -> str | Path | _RawVideo:
    if isinstance(item, dict):
        kind = item.get("type")
        if kind == "text" and isinstance(item.get("text"), str):
            return item["text"]
        if kind == "video" and "video" in item:
            return _RawVideo(item["video"], item.get("fps"))
        path = item.get("image", item.get("path"))
        if kind in ("image", None) and isinstance(path, str) and path:
            if "://" in path:
                _bad(key, "bad_schema", f"image {path!r} is a URL: download it and give a path")
            return Path(path)
    _bad(key, "bad_schema",
         'content items must be {"type": "text", "text": ...}, {"type": "image", "image": PATH} '
         'or {"type": "video", "video": PATH or [FRAME, ...]}'
         f", got {item!r:.80}")  # fmt: skip


def _sharegpt_turns(conversations: Any, key: str) -> _Turns:
    if not isinstance(conversations, list) or not all(
        isinstance(t, dict) and isinstance(t.get("value"), str) for t in conversations
    ):
        _bad(key, "bad_schema", '"conversations" must be a list of {"from", "value": str} objects')
    turns: _Turns = []
    for i, t in enumerate(conversations):
        role = _role(t.get("from"), key, '"from"')
        if t["from"] != "function_call":
            turns.append(_Turn(role, [t["value"]], loss=_loss(t, role, key, i)))
            continue
        calls = _nested_json(t["value"], key, "bad_tool_call",
                             f"turn {i}: a function_call value, a call (or a list of calls) as "
                             "JSON,")
        turns.append(_Turn(role, [], _tool_calls(calls, key, i), _loss(t, role, key, i)))
    return turns


_PLACEHOLDERS = re.compile(f"({re.escape(IMAGE_PLACEHOLDER)}|{re.escape(VIDEO_PLACEHOLDER)})")


def _split_placeholders(text: str, queues: dict[str, list]) -> list[str | ImageRef | VideoRef]:
    """`text` with each placeholder replaced by the next item of its queue."""
    out: list[str | ImageRef | VideoRef] = []
    for piece in _PLACEHOLDERS.split(text):
        if piece in queues:
            out.append(queues[piece].pop(0))
        elif piece:
            out.append(piece)
    return out


def _validate(conv: Conversation) -> None:
    key = conv.key
    roles = [m.role for m in conv.messages]
    if "system" in roles[1:]:
        _bad(key, "bad_schema", "a system message may only come first: merge it into the first")
    for m in conv.messages:
        texts = [c for c in m.content if isinstance(c, str)]
        if m.role not in ("user", "tool") and len(texts) != len(m.content):
            _bad(key, "bad_schema",
                 f"images and videos are only supported in user and tool turns, found one in a "
                 f"{m.role} turn")
        for t in (*texts, m.reasoning or ""):
            if any(r in t for r in RESERVED):
                _bad(key, "bad_schema",
                     f"text contains a reserved vision token ({', '.join(RESERVED)}): use "
                     f"{IMAGE_PLACEHOLDER}/{VIDEO_PLACEHOLDER} or an image/video item "
                     "instead")
    if "assistant" not in roles:
        _bad(key, "no_assistant_turn", "no assistant turn: nothing to learn from; add an answer")
    if not any(m.loss for m in conv.messages if m.role == "assistant"):
        _bad(key, "no_supervised_turn", 'every assistant turn has "loss": false: nothing to '
             "learn from; supervise one or drop the sample")
    _validate_tools(conv)
    if "user" not in roles:
        _bad(key, "bad_schema", "no user turn: add the question the assistant answers")
    turns = [r for r in roles if r != "system"]
    if turns[0] == "assistant":
        _bad(key, "bad_schema",
             "the conversation starts with an assistant turn, an answer to no question: start "
             "with the user's turn (after an optional system message) or drop the answer")
    if turns[-1] in ("user", "tool"):
        _bad(key, "bad_schema",
             f"the conversation ends with a {turns[-1]} turn that nothing answers (training "
             "supervises only answers, so it would be input with no target): add the answer or "
             "drop the turn")
    for i, m in enumerate(conv.messages):
        if m.role == "assistant" and not m.tool_calls and not (m.reasoning or "").strip() \
                and not "".join(m.content).strip():  # type: ignore[arg-type]
            _bad(key, "empty_assistant_turn",
                 f"assistant turn {i} is empty: drop the turn or give it text")  # fmt: skip


def _validate_tools(conv: Conversation) -> None:
    """Each tool result follows an assistant turn (its call, as tool_calls or in its text) or
    another result; with `tools` given, each call names one of them."""
    names = {t.get("function", t)["name"] for t in conv.tools}
    for i, m in enumerate(conv.messages):
        if m.role == "tool" and (i == 0 or conv.messages[i - 1].role not in ("assistant",
                                                                              "tool")):
            _bad(conv.key, "bad_schema", f"tool turn {i} answers no call: put it after the "
                 "assistant turn that calls the tool")
        for call in m.tool_calls:
            if names and call.name not in names:
                _bad(conv.key, "bad_tool_call", f"turn {i} calls {call.name!r}, which is not in "
                     f"the record's tools ({', '.join(sorted(names))}): add its schema to "
                     '"tools" or fix the name')
