"""Hugging Face `datasets` as a source (`data.source=hf`): rows read on demand.

`path` is a folder written by `Dataset.save_to_disk`, a `.parquet` or `.arrow` file, or a
folder of them. The rows stay in Arrow files, memory-mapped (parquet is converted once into
`datasets`' own cache, as `datasets` does); a row is read when the planner measures it or a
worker encodes it, so no process holds the whole set in memory.

A row is a record of the JSONL shapes (`sources.py`, whose parser reads it): a `messages` or a
`conversations` column, optional `id`, `tools`, `image`/`images`, `video`/`videos`. A dataset
with neither conversation column (a VQA set's `question`/`answer`) is refused when opened, with
the `Dataset.map` that makes one. Differences, all from Arrow:

- Images are an `Image` feature (or a list of them): each value is encoded bytes or a path.
  Bytes are decoded by `media.open_image` like files are (the pixel limit, EXIF orientation,
  corrupt data a bad sample); a path must resolve inside the media root (`data.media_root`,
  by default the dataset's folder), as in JSONL.
- A content item `{"type": "image"}` without a path (the layout TRL and most hub VLM sets use)
  takes the next image of the row's `images`, as an `<image>` placeholder does; a
  `{"type": "video"}` item the next of `videos`. An item with an `index` (TRL's
  `{"type": "image", "index": 0, "text": null}`) takes `images[index]`; the indices of a row's
  items must name each of its images once.
- Arrow fills a struct's absent fields with null: null fields are dropped before parsing.
- Videos are paths or lists of frame paths (strings); a video stored as bytes is refused.

The key of a row is its `id`, else `NAME[ROW]` (0-based, `dataset[ROW]` in `datasets`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, overload

from vlpack.data.media import DataFile
from vlpack.data.sources import (
    IMAGE_PLACEHOLDER,
    MAX_RECORD_BYTES,
    VIDEO_PLACEHOLDER,
    parse_record,
)
from vlpack.data.types import BadSampleError, Conversation, ImageRef

Item = Conversation | BadSampleError

_BATCH = 1024
"""Rows read at once when iterating (measuring) in order."""


def require_datasets(what: str) -> Any:
    """The `datasets` module, or a ValueError naming the extra that installs it."""
    try:
        import datasets
    except ImportError:
        raise ValueError(f"{what} needs the Hugging Face `datasets` package: pip install "
                         "'vlpack[hf]'") from None
    return datasets


def load_hf(path: str | Path) -> Any:
    """The `datasets.Dataset` at `path` (a save_to_disk folder, .parquet/.arrow files or a
    folder of them), memory-mapped; ValueError naming the fix when `path` is none of these."""
    datasets = require_datasets("data.source=hf")
    p = Path(path)
    if not p.exists():
        raise ValueError(f"data.path={path} does not exist: pass a folder written by "
                         "Dataset.save_to_disk, or .parquet/.arrow files")
    if p.is_dir() and (p / "dataset_dict.json").is_file():
        splits = sorted(q.name for q in p.iterdir() if q.is_dir())
        raise ValueError(f"{path} holds a DatasetDict (splits: {', '.join(splits)}): pass one "
                         f"split's folder, e.g. data.path={p / (splits[0] if splits else 'train')}")
    if p.is_dir() and (p / "state.json").is_file():
        _inside(p, [p / _state_file(p, f) for f in _state(p).get("_data_files", [])])
        return datasets.load_from_disk(str(p))
    files = (sorted(p.glob("*.parquet")) or sorted(p.glob("*.arrow"))) if p.is_dir() else [p]
    if p.is_dir():
        _inside(p, files)
    if not files or files[0].suffix not in (".parquet", ".arrow"):
        raise ValueError(f"{path} is not a Hugging Face dataset: pass a folder written by "
                         "Dataset.save_to_disk, a .parquet or .arrow file, or a folder of them")
    if files[0].suffix == ".parquet":
        return datasets.Dataset.from_parquet([str(f) for f in files])
    return datasets.concatenate_datasets([datasets.Dataset.from_file(str(f)) for f in files])


def _state(folder: Path) -> dict:
    """A save_to_disk folder's state.json; ValueError naming it when it is not a JSON object."""
    import json

    try:
        state = json.loads((folder / "state.json").read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as e:
        raise ValueError(f"{folder / 'state.json'} is not valid JSON ({e}): write the dataset "
                         "again with Dataset.save_to_disk") from None
    if not isinstance(state, dict):
        raise ValueError(f"{folder / 'state.json'} is not a JSON object: write the dataset "
                         "again with Dataset.save_to_disk")
    return state


def _state_file(folder: Path, entry: Any) -> str:
    """The file name of one `_data_files` entry of `folder`'s state.json."""
    if not isinstance(entry, dict) or not isinstance(entry.get("filename"), str):
        raise ValueError(f"{folder / 'state.json'} lists a data file without a file name "
                         f"({entry!r:.80}): write the dataset again with Dataset.save_to_disk")
    return entry["filename"]


def _inside(folder: Path, files: list[Path]) -> None:
    """ValueError naming the first of `files` that lies outside `folder` once absolute paths,
    `..` and symbolic links are resolved: a dataset folder is untrusted, and its state.json or
    a link in it could otherwise bring any Arrow or Parquet file on the machine into training."""
    root = folder.resolve()
    for f in files:
        if not f.resolve().is_relative_to(root):
            raise ValueError(f"{folder} names the data file {f}, which lies outside the folder "
                             f"(at {f.resolve()}): a dataset reads only its own files; copy the "
                             "file into the folder or write the dataset again with "
                             "Dataset.save_to_disk")


def _check_columns(columns: list[str], path: Path) -> None:
    """ValueError naming the fix when the dataset has no conversation column (a VQA set's
    `question`/`answer`, The Cauldron's `texts`): every row would be a bad sample."""
    if "messages" in columns or "conversations" in columns:
        return
    raise ValueError(
        f"{path} has the columns {', '.join(columns)} but no \"messages\" or \"conversations\" "
        "column: map each row to a conversation and save it, e.g. ds.map(lambda r: "
        '{"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", '
        '"text": r["question"]}]}, {"role": "assistant", "content": r["answer"]}]}'
        ").save_to_disk(PATH), keeping the images in an \"images\" column (docs/data.md, "
        "Hugging Face datasets)")


class HFRows(Sequence[Item]):
    """The rows of a Hugging Face dataset as `Conversation`s (bad rows as their
    `BadSampleError`), converted when indexed; picklable (workers reopen the memory-map).
    Image and video paths are joined to the dataset's folder and must resolve inside the file's
    media root (a bare path: that folder)."""

    def __init__(self, file: DataFile | str | Path, *, _table: Any = None,
                 _rows: range | None = None) -> None:
        self.file = DataFile.of(file)
        p = self.file.path
        self.path, self.name = p, p.name
        self.table = (_table if _table is not None else load_hf(p)).with_format("arrow")
        self.rows = _rows if _rows is not None else range(len(self.table))
        if _table is None:
            _check_columns(self.table.column_names, p)

    def __len__(self) -> int:
        return len(self.rows)

    @overload
    def __getitem__(self, i: int) -> Item: ...
    @overload
    def __getitem__(self, i: slice) -> HFRows: ...

    def __getitem__(self, i):
        if isinstance(i, slice):
            return HFRows(self.file, _table=self.table, _rows=self.rows[i])
        row = self.rows[i]
        return self.item(row, self.table[row].to_pylist()[0])

    def __iter__(self) -> Iterator[Item]:
        for start in range(0, len(self.rows), _BATCH):
            chunk = self.rows[start:start + _BATCH]
            part = self.table[chunk.start:chunk.stop] if chunk.step == 1 else \
                self.table.select(list(chunk))[:]
            records = part.to_pylist()
            for row, record in zip(chunk, records, strict=True):
                yield self.item(row, record)

    def item(self, row: int, record: dict) -> Item:
        """Row `row` (its raw Arrow values in `record`) as a Conversation or its error."""
        where = f"{self.name}[{row}]"
        has_id = record.get("id") not in (None, "")
        key = str(record["id"]) if has_id else where
        try:
            if (chars := _text_chars(record)) > MAX_RECORD_BYTES:
                raise BadSampleError(
                    "record_too_large", f"{key}: the row holds {chars:,} characters of text, "
                    f"over the {MAX_RECORD_BYTES // 2**20} MiB a record may be: split the "
                    "conversation into several rows, or drop the row")
            obj = _drop_nulls(record)
            listed = _listed(obj, key, "image", "images")
            order = _by_index(obj, "image", len(listed), key) or range(len(listed))
            images = [self._image(listed[j], key, j) for j in order]
            obj.pop("image", None)
            obj.pop("images", None)
            for name in ("video", "videos"):
                if name in obj:
                    obj[name] = _video_paths(obj[name], key)
            n_videos = len(obj["videos"]) if isinstance(obj.get("videos"), list) else \
                int("video" in obj)
            if (order := _by_index(obj, "video", n_videos, key)) and "videos" in obj:
                obj["videos"] = [obj["videos"][j] for j in order]
            _placeholders(obj)
            conv = parse_record(obj, file=self.file, key=key, images=images)
            return conv if not has_id else _with_where(conv, where)
        except BadSampleError as e:
            if has_id:
                e.args = (f"{e} [{where}]",)
            return e

    def _image(self, value: Any, key: str, j: int) -> ImageRef:
        """An `Image` value ({bytes, path}) or a path string as an ImageRef."""
        if isinstance(value, str):
            value = {"path": value}
        if not isinstance(value, dict) or not (value.get("bytes") or value.get("path")):
            raise BadSampleError("bad_schema", f"{key}: image {j} is {value!r:.80}: store "
                                 "images as a datasets Image feature (bytes or a path)")
        if value.get("bytes"):
            return ImageRef(path=Path(f"{key} image {j}"), data=value["bytes"])
        return ImageRef(path=self.file.media(value["path"], key, "image"))


def _with_where(conv: Conversation, where: str) -> Conversation:
    import dataclasses

    return dataclasses.replace(conv, where=where)


def _text_chars(x: Any) -> int:
    """Characters of text in a row's values (image bytes not counted: the pixel limit bounds
    an image), so a row is held to the size cap of a JSONL record before it is tokenized."""
    total, stack = 0, [x]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            total += len(v)
        elif isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return total


def _drop_nulls(x: Any) -> Any:
    """`x` without the null fields Arrow fills absent struct fields with."""
    if isinstance(x, dict):
        return {k: _drop_nulls(v) for k, v in x.items() if v is not None}
    if isinstance(x, list):
        return [_drop_nulls(v) for v in x]
    return x


def _listed(obj: dict, key: str, one: str, many: str) -> list:
    """The row's values under `one` or `many` (not both) as a list."""
    if one in obj and many in obj:
        raise BadSampleError("bad_schema", f'{key}: the row has both "{one}" and "{many}" '
                             "set: keep one of them")
    value = obj.get(many, obj.get(one, []))
    return value if isinstance(value, list) else [value]


def _video_paths(value: Any, key: str) -> Any:
    """Videos as JSONL gives them: a path, frame paths, or `Video`/`Image` values by path."""
    if isinstance(value, dict):
        if value.get("path") and not value.get("bytes"):
            return value["path"]
        raise BadSampleError("bad_schema", f"{key}: a video stored as bytes is not read: store "
                             "videos as file paths or lists of frame paths")
    if isinstance(value, list):
        return [_video_paths(v, key) for v in value]
    return value


def _slots(obj: dict) -> Iterator[tuple[list, int]]:
    """(content list, position) of each `{"type": ...}` item of the row's messages that names
    no file (at most an `index` besides its type): an image or video the row's columns hold."""
    turns = obj["messages"] if "messages" in obj else obj.get("conversations")
    for m in turns if isinstance(turns, list) else ():
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list):
            continue
        for n, item in enumerate(content):
            if isinstance(item, dict) and "type" in item and set(item) <= {"type", "index"}:
                yield content, n


def _by_index(obj: dict, kind: str, n: int, key: str) -> list[int] | None:
    """The entries of the row's `n` images (or videos) that its `{"type": kind}` items take,
    in the items' order: an item's `index` (TRL's layout) when given, else its position among
    them. None when no item gives an index (each then takes the next, as `<image>` does)."""
    items = [content[i] for content, i in _slots(obj) if content[i]["type"] == kind]
    if not any("index" in item for item in items):
        return None
    column = f'"{kind}s"'
    order = []
    for p, item in enumerate(items):
        j = item.get("index", p)
        if isinstance(j, bool) or not isinstance(j, int) or not 0 <= j < n:
            raise BadSampleError("bad_schema", f'{key}: {kind} item {p} has "index": {j!r:.40}, '
                                 f"but the row holds {n} {kind}(s) in {column}: give each "
                                 f"{kind} item the 0-based position of its {kind} in {column}, "
                                 "or drop the index to take them in order")
        order.append(j)
    if sorted(order) != list(range(n)):
        raise BadSampleError("bad_schema", f'{key}: the {kind} items\' "index" values {order} '
                             f"do not name each of the row's {n} {kind}(s) in {column} once: "
                             f"give one {kind} item per {kind}, indexed 0 to {n - 1}")
    return order


def _placeholders(obj: dict) -> None:
    """`{"type": "image"}` / `{"type": "video"}` items without a path become `<image>` /
    `<video>` text, which take the row's next image / video (in place; `_by_index` has
    already put the row's images and videos in the order their items take them)."""
    for content, n in _slots(obj):
        tag = {"image": IMAGE_PLACEHOLDER, "video": VIDEO_PLACEHOLDER}.get(content[n]["type"])
        if tag is not None:
            content[n] = {"type": "text", "text": tag}
