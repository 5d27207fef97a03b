"""Sample sizes measured once, in parallel, and cached on disk.

`sample_sizes(items, encoder, file)` returns what `loader.measure_all` returns — each sample's
`SampleSize`, or the `BadSampleError` of a bad one — as a compact `SizeIndex` (12 bytes per
sample). The sizes are stored in `$VLPACK_CACHE/sizes/` (default `~/.cache/vlpack`) under a key
made of:

- the source's content: a data file's byte count and a BLAKE2b hash of all its bytes (a copy or a
  `touch` keeps the cache, any changed byte re-measures; the hash is taken with the line index in
  one pass, `file_scan.py`, and not again while the file's status is unchanged); a folder (a
  Hugging Face dataset) by each file's name, byte count and modification time (its image bytes
  can be many GB, too many to hash at each start);
- its media root (the `DataFile`'s): a given `data.media_root` as the folder it resolves to,
  the default (the data file's folder) as none, so it moves with a copy;
- every attribute of the encoder (`Encoder.length_settings`: family, tokenizer content, chat
  template, pixel bounds, video settings, think supervision, ...), so a new encoder setting is
  part of the key without anyone adding it here;
- the source code of `vlpack.data` (a changed measuring rule re-measures) and `FORMAT`.

The record names the media files each sample uses (a table of distinct files with the byte count
and modification time each had when measured): a sample whose media changed is measured again at
the next start (only that sample). Read from the same data file, a warm start stats each distinct
file once and parses no record; read from a copy elsewhere, it parses every record to find its
media. Images a dataset holds as bytes are covered by the source's fingerprint. Bad samples are
judged again at every start (they are few, and their messages name the file and media paths of
this start).

Measuring runs in `workers` forked processes over contiguous shares. With several ranks, the first
process of each node (`LOCAL_RANK` 0) measures and writes the cache; the others wait for the file
and read it (or stop with the error the first process noted for their launch, if it failed).
`VLPACK_SIZE_CACHE=off` turns the cache off (every rank measures, as without it).
"""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing
import os
import re
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, is_dataclass
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from vlpack.data.file_scan import cache_root, scan
from vlpack.data.media import DataFile
from vlpack.data.types import BadSampleError, Conversation, ImageRef, SampleSize, VideoRef, located

FORMAT = 2
"""Version of the cache files; a new layout gets a new number (and new files)."""
WAIT_S = float(os.environ.get("VLPACK_SIZE_CACHE_WAIT", 7200))
"""How long a rank that does not measure waits for the cache file (seconds)."""

log = logging.getLogger("vlpack.data")
SizeOrError = SampleSize | BadSampleError


# ------------------------------------------------------------------ the index


class SizeIndex(Sequence[SizeOrError]):
    """Sizes of `n` samples in three int32 arrays; `errors` maps a bad sample's index to its
    error (its arrays hold -1). Indexing gives a `SampleSize` or the error; slicing a SizeIndex."""

    def __init__(self, tokens: np.ndarray, patches: np.ndarray, video_patches: np.ndarray,
                 errors: dict[int, BadSampleError]):
        assert len(tokens) == len(patches) == len(video_patches)
        self.tokens, self.patches, self.video_patches = tokens, patches, video_patches
        self.errors = errors

    @classmethod
    def of(cls, sizes: Sequence[SizeOrError]) -> SizeIndex:
        """The index of a list of sizes and errors."""
        n = len(sizes)
        arr = np.full((3, n), -1, dtype=np.int32)
        errors = {}
        for i, s in enumerate(sizes):
            if isinstance(s, BadSampleError):
                errors[i] = s
            else:
                arr[:, i] = (s.tokens, s.patches, s.video_patches)
        return cls(arr[0], arr[1], arr[2], errors)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i):
        if isinstance(i, slice):
            lo, hi, step = i.indices(len(self))
            assert step == 1, "a SizeIndex slices contiguously"
            errs = {j - lo: e for j, e in self.errors.items() if lo <= j < hi}
            return SizeIndex(self.tokens[i], self.patches[i], self.video_patches[i], errs)
        i = int(i) + (len(self) if i < 0 else 0)
        if i in self.errors:
            return self.errors[i]
        return SampleSize(int(self.tokens[i]), int(self.patches[i]), int(self.video_patches[i]))

    @property
    def nbytes(self) -> int:
        """Bytes of the arrays (errors excluded: they are few and hold their messages)."""
        return self.tokens.nbytes + self.patches.nbytes + self.video_patches.nbytes


# ------------------------------------------------------------------ keys


def cache_dir() -> Path | None:
    """Where size files live (`$VLPACK_CACHE/sizes`), or None when `VLPACK_SIZE_CACHE=off`."""
    root = cache_root()
    return None if root is None else root / "sizes"


def source_fingerprint(path: str | Path) -> str:
    """The content fingerprint of a data file (byte count + BLAKE2b of its bytes, read once
    with its line index by `file_scan.scan`, not again while the file's status is unchanged)
    or of a folder (each file's relative name, byte count and modification time)."""
    p = Path(path)
    if not p.is_dir():
        return scan(p).digest
    h = hashlib.blake2b(digest_size=16)
    for f in sorted(q for q in p.rglob("*") if q.is_file()):
        st = f.stat()
        h.update(f"{f.relative_to(p)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return "dir-" + h.hexdigest()


_HASHED: dict[int, tuple[object, str]] = {}
"""Content hashes of tokenizers by object id (the object is kept so its id is not reused)."""


def _tokenizer_hash(tok) -> str:
    backend = getattr(tok, "backend_tokenizer", tok)  # a fast tokenizer and its backend: once
    if id(backend) not in _HASHED:
        digest = hashlib.blake2b(backend.to_str().encode(), digest_size=16).hexdigest()
        _HASHED[id(backend)] = (backend, digest)
    return _HASHED[id(backend)][1]


def setting_value(name: str, v: object) -> object:
    """A JSON value that changes when `v` changes (tokenizers by their content's hash); raises
    TypeError for a type it does not know, so an unknown new encoder attribute fails loudly."""
    if v is None or isinstance(v, bool | int | float | str):
        return v
    if isinstance(v, Path):
        return str(v)
    if isinstance(v, re.Pattern):
        return v.pattern
    if is_dataclass(v) and not isinstance(v, type):
        return setting_value(name, asdict(v))
    if isinstance(v, dict):
        return {str(k): setting_value(f"{name}.{k}", x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [setting_value(name, x) for x in v]
    if hasattr(v, "to_str") or hasattr(v, "backend_tokenizer"):
        return "tokenizer:" + _tokenizer_hash(v)
    raise TypeError(f"encoder attribute {name!r} of type {type(v).__name__} has no cache "
                    "fingerprint: add its type to vlpack.data.size_cache.setting_value")


def _code_hash() -> str:
    h = hashlib.blake2b(digest_size=8)
    for f in sorted(Path(__file__).parent.glob("*.py")):
        h.update(f.read_bytes())
    return h.hexdigest()


def settings_key(settings: dict) -> str:
    """The hash of an encoder's `length_settings()`, the code and the format."""
    text = json.dumps([FORMAT, _code_hash(), settings], sort_keys=True)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


# ------------------------------------------------------------------ measuring


def media_files(item) -> list[str]:
    """Every media file `item` names (images, video files, frames), as resolved paths; none
    for images held as bytes or for a bad record."""
    if not isinstance(item, Conversation):
        return []
    files: list[Path] = []
    for v in item.visuals:
        if isinstance(v, ImageRef):
            if v.data is None:
                files.append(v.path)
        elif isinstance(v, VideoRef):
            files.extend([v.path] if v.path is not None else v.frames)
    return [str(f) for f in files]


def stamp(file: str) -> tuple[int, int]:
    """(byte count, modification time ns) of `file`; (-1, -1) when it is missing."""
    try:
        st = os.stat(file)
    except OSError:
        return -1, -1
    return st.st_size, st.st_mtime_ns


@dataclass(slots=True)
class _Part:
    """Sizes of samples lo..hi and the media files each names, stamped when it was measured
    (what a worker sends back)."""

    lo: int
    sizes: np.ndarray
    errors: dict[int, tuple[str, str]] = field(default_factory=dict)
    media: list[list[tuple[str, int, int]]] = field(default_factory=list)


def measure_one(item, encoder) -> SizeOrError:
    """One sample's size, or its error located at its `file:line`."""

    if isinstance(item, BadSampleError):
        return item
    try:
        return encoder.measure(item)
    except BadSampleError as e:
        return located(e, item)


def measuring_bar(total: int, show_progress: bool) -> tqdm:
    """The `measuring samples` bar, shown with `show_progress` on a terminal only: in a log file
    (stderr redirected) its redraws would pile up."""
    return tqdm(total=total, desc="measuring samples", unit="sample",
                disable=not (show_progress and sys.stderr.isatty()))


def _measure_range(items, encoder, lo: int, hi: int) -> _Part:
    part = _Part(lo, np.full((3, hi - lo), -1, dtype=np.int32))
    for j in range(lo, hi):
        item = items[j]
        s = measure_one(item, encoder)
        if isinstance(s, BadSampleError):
            part.errors[j] = (s.reason, str(s))
        else:
            part.sizes[:, j - lo] = (s.tokens, s.patches, s.video_patches)
        part.media.append([(f, *stamp(f)) for f in media_files(item)])
    return part


_FORKED: tuple | None = None
"""(items, encoder) that forked workers inherit."""


def _work(span: tuple[int, int]) -> _Part:
    items, encoder = _FORKED
    return _measure_range(items, encoder, *span)


def measure_parallel(items: Sequence, encoder, indices: Sequence[int] | None = None, *,
                     workers: int = 0, show_progress: bool = False) -> list[_Part]:
    """Parts covering `indices` (default: all), measured in `workers` forked processes (0 or 1:
    in this one). Parts are contiguous runs, in order."""
    idx = np.arange(len(items)) if indices is None else np.asarray(indices, dtype=np.int64)
    runs = _runs(idx, chunk=max(64, -(-len(idx) // max(1, workers * 16))))
    bar = measuring_bar(len(idx), show_progress)
    parts: list[_Part] = []
    if workers <= 1 or len(runs) <= 1:
        for lo, hi in runs:
            parts.append(_measure_range(items, encoder, lo, hi))
            bar.update(hi - lo)
    else:
        global _FORKED
        _FORKED = (items, encoder)
        try:
            with multiprocessing.get_context("fork").Pool(workers) as pool:
                for part in pool.imap(_work, runs):
                    parts.append(part)
                    bar.update(part.sizes.shape[1])
        finally:
            _FORKED = None
    bar.close()
    return parts


def _runs(idx: np.ndarray, chunk: int) -> list[tuple[int, int]]:
    """Contiguous (lo, hi) runs of the sorted `idx`, each at most `chunk` long."""
    out = []
    start = 0
    for k in range(1, len(idx) + 1):
        if k == len(idx) or idx[k] != idx[k - 1] + 1 or k - start >= chunk:
            out.append((int(idx[start]), int(idx[k - 1]) + 1))
            start = k
    return out


# ------------------------------------------------------------------ the file


@dataclass(slots=True)
class _Cached:
    """A cache file's content: the sizes, and the media each sample names as indices into a
    table of distinct files with the stamps they had when measured."""

    index: SizeIndex
    refs_off: np.ndarray  # [n + 1] int64: sample i names table[refs[refs_off[i]:refs_off[i+1]]]
    refs: np.ndarray  # int32
    table: list[str]
    stamps: np.ndarray  # [len(table), 2] int64: byte count, modification time ns
    path: str = ""  # the data file's absolute path when the sizes were measured

    def sample_stamps(self, i: int) -> list[tuple[int, int]]:
        """Stamps of the media sample `i` names, in order."""
        return [tuple(x) for x in self.stamps[self.refs[self.refs_off[i]:self.refs_off[i + 1]]]
                .tolist()]


def _assemble(n: int, parts: list[_Part], base: _Cached | None = None) -> _Cached:
    """A full record from measured parts, over `base` for the samples they do not cover."""
    table: dict[str, tuple[int, int]] = {}
    if base is not None:
        arr = np.stack([base.index.tokens, base.index.patches, base.index.video_patches]).copy()
        errs = {i: (e.reason, str(e)) for i, e in base.index.errors.items()}
        table = {f: tuple(st) for f, st in zip(base.table, base.stamps.tolist(), strict=True)}
        names = base.table
        per = [[names[k] for k in base.refs[base.refs_off[i]:base.refs_off[i + 1]]]
               for i in range(n)]
    else:
        arr, errs, per = np.full((3, n), -1, dtype=np.int32), {}, [[] for _ in range(n)]
    for p in parts:
        hi = p.lo + p.sizes.shape[1]
        arr[:, p.lo:hi] = p.sizes
        for i in range(p.lo, hi):
            errs.pop(i, None)
        errs.update(p.errors)
        for k, media in enumerate(p.media):
            per[p.lo + k] = [f for f, *_ in media]
            table.update((f, (size, mtime)) for f, size, mtime in media)  # the newest stamp
    used = sorted({f for files in per for f in files})
    slot = {f: k for k, f in enumerate(used)}
    off = np.zeros(n + 1, dtype=np.int64)
    off[1:] = np.cumsum([len(files) for files in per])
    refs = np.fromiter((slot[f] for files in per for f in files), dtype=np.int32,
                       count=int(off[-1]))
    stamps = np.array([table[f] for f in used], dtype=np.int64).reshape(-1, 2)
    errors = {i: BadSampleError(r, m) for i, (r, m) in errs.items()}
    return _Cached(SizeIndex(arr[0], arr[1], arr[2], errors), off, refs, used, stamps)


def _save(file: Path, rec: _Cached, meta: dict) -> None:
    file.parent.mkdir(parents=True, exist_ok=True)
    tmp = file.with_name(f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}.npz")
    errors = [[i, e.reason, str(e)] for i, e in sorted(rec.index.errors.items())]
    ix = rec.index
    np.savez(tmp, tokens=ix.tokens, patches=ix.patches, video_patches=ix.video_patches,
             refs_off=rec.refs_off, refs=rec.refs, stamps=rec.stamps,
             table=np.array("\0".join(rec.table)),
             meta=np.array(json.dumps({**meta, "errors": errors})))
    os.replace(tmp, file)


def _load(file: Path, n: int) -> _Cached | None:
    try:
        with np.load(file, allow_pickle=False) as z:
            meta = json.loads(str(z["meta"]))
            index = SizeIndex(z["tokens"], z["patches"], z["video_patches"],
                              {i: BadSampleError(r, m) for i, r, m in meta["errors"]})
            table = str(z["table"])
            rec = _Cached(index, z["refs_off"], z["refs"], table.split("\0") if table else [],
                          z["stamps"], meta.get("path", ""))
    except (OSError, ValueError, KeyError) as e:
        log.warning("size cache %s is unreadable (%s): measuring again", file, e)
        return None
    return rec if len(index) == n else None


def _changed(rec: _Cached, items: Sequence, path: str | Path) -> tuple[list[int], str]:
    """Samples to measure again, and why: bad ones (their messages name this start's paths)
    and those whose media changed since. Read at the same place, the table's files are stat'd
    once each (no record is parsed); moved or copied, each record is parsed again to find its
    media, which are compared by their stamps."""
    n = len(rec.index)
    bad = set(rec.index.errors)
    if not rec.table:
        moved: list[int] = []
    elif rec.path == str(Path(path).absolute()):
        now = np.array([stamp(f) for f in rec.table], dtype=np.int64).reshape(-1, 2)
        touched = (now != rec.stamps).any(axis=1)
        seen = np.concatenate([[0], np.cumsum(touched[rec.refs])])
        moved = np.flatnonzero(seen[rec.refs_off[1:]] > seen[rec.refs_off[:-1]]).tolist()
    else:
        log.info("%s was measured as %s: parsing every record to check its media", path,
                 rec.path)
        moved = [i for i in range(n) if [stamp(f) for f in media_files(items[i])]
                 != rec.sample_stamps(i)]
    changed = sorted(bad.union(moved))
    why = f"{len(bad)} bad, {len(moved)} naming media that changed"
    return changed, why


# ------------------------------------------------------------------ the entry point


def local_rank(rank: int) -> int:
    """This process's rank on its node: torchrun's LOCAL_RANK, SLURM's SLURM_LOCALID, else
    `rank`."""
    return int(os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", rank)))


def sample_sizes(items: Sequence, encoder, file: DataFile | str | Path | None, *,
                 workers: int = 0, rank: int = 0, show_progress: bool = False) -> SizeIndex:
    """Every sample's size or error (as `loader.measure_all`) of `items`, the records of
    `file` (None: not cached), from the cache when it holds them for this source content,
    media root and these encoder settings, else measured with `workers` processes and stored.
    Off the node's first process, waits for that process's file."""
    folder = cache_dir()
    if folder is None or file is None or not hasattr(encoder, "length_settings"):
        return SizeIndex.of([p for part in measure_parallel(items, encoder, workers=workers,
                                                            show_progress=show_progress)
                             for p in _part_sizes(part)])
    file = DataFile.of(file)
    path = file.path
    # a given root as the folder it names (a relative one names another folder from another
    # working directory); the default root, the data file's folder, moves with a copy
    root = None if file.media_root is None else str(file.root)
    settings = {**encoder.length_settings(), "data.media_root": root}
    source = source_fingerprint(path)
    file = folder / f"{source[-32:]}-{settings_key(settings)}.npz"
    measurer = local_rank(rank) == 0
    if not measurer:
        _wait_for(file)
    try:
        return _read_or_measure(items, encoder, path, folder, file, source, settings,
                                workers=workers, show_progress=show_progress, write=measurer)
    except BaseException as e:
        if measurer and _job() is not None:  # the waiting ranks stop now, not at the timeout
            file.parent.mkdir(parents=True, exist_ok=True)
            _failed(file).write_text(json.dumps({"job": _job(), "error": repr(e)}))
        raise


def _read_or_measure(items: Sequence, encoder, path, folder: Path, file: Path, source: str,
                     settings: dict, *, workers: int, show_progress: bool, write: bool) -> SizeIndex:
    n = len(items)
    rec = _load(file, n) if file.is_file() else None
    if rec is None:
        _say_why(folder, path, source, settings, n, workers)
        rec = _assemble(n, measure_parallel(items, encoder, workers=workers, show_progress=show_progress))
    else:
        # A bad sample is judged again: its message names the file it was read from and the
        # media it resolved, which differ for the same bytes in another folder.
        changed, why = _changed(rec, items, path)
        if not changed:
            log.info("sizes of %d samples of %s read from %s", n, path, file)
            return rec.index
        log.info("sizes of %s read from %s; measuring %d of %d samples again (%s)", path, file,
                 len(changed), n, why)
        rec = _assemble(n, measure_parallel(items, encoder, changed, workers=workers), rec)
    if write:
        _save(file, rec, {"path": str(Path(path).absolute()), "source": source,
                          "settings": settings})
        _remember(folder, path, source, settings)
    return rec.index


def _part_sizes(part: _Part) -> list[SizeOrError]:
    out: list[SizeOrError] = []
    for k in range(part.sizes.shape[1]):
        i = part.lo + k
        if i in part.errors:
            out.append(BadSampleError(*part.errors[i]))
        else:
            out.append(SampleSize(*(int(x) for x in part.sizes[:, k])))
    return out


def _job() -> str | None:
    """This launch's id, the same on all its ranks (torchrun's run id and restart count, else
    SLURM's job and step), or None."""
    env = os.environ
    if "TORCHELASTIC_RUN_ID" in env:
        return f"torchrun:{env['TORCHELASTIC_RUN_ID']}:{env.get('TORCHELASTIC_RESTART_COUNT')}"
    if "SLURM_JOB_ID" in env:
        return f"slurm:{env['SLURM_JOB_ID']}.{env.get('SLURM_STEP_ID')}"
    return None


def _failed(file: Path) -> Path:
    """The note a measuring process that failed leaves for the ranks waiting on `file`."""
    return file.with_name(file.name + ".failed")


def _wait_for(file: Path) -> None:
    t0 = last = time.monotonic()
    job = _job()
    while not file.is_file():
        now = time.monotonic()
        if job is not None and _failed(file).is_file():
            try:
                note = json.loads(_failed(file).read_text())
            except (OSError, ValueError):
                note = {}
            if note.get("job") == job:
                raise RuntimeError(f"this node's first process (LOCAL_RANK 0) failed to measure "
                                   f"the sample sizes ({note['error']}): see its log")
        if now - t0 > WAIT_S:
            raise TimeoutError(
                f"waited {WAIT_S:.0f} s for the size cache {file} that this node's first process "
                "(LOCAL_RANK 0) writes: did it fail? Raise VLPACK_SIZE_CACHE_WAIT, or set "
                "VLPACK_SIZE_CACHE=off to measure on every rank")
        if now - last > 60:
            log.info("waiting for this node's first process to measure sizes into %s", file)
            last = now
        time.sleep(0.2)


def _pointer(folder: Path, path: str | Path) -> Path:
    name = hashlib.blake2b(str(Path(path).absolute()).encode(), digest_size=8).hexdigest()
    return folder / "by-path" / f"{name}.json"


def _remember(folder: Path, path, source: str, settings: dict) -> None:
    p = _pointer(folder, path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    tmp.write_text(json.dumps({"source": source, "settings": settings}))
    os.replace(tmp, p)


def _say_why(folder: Path, path, source: str, settings: dict, n: int, workers: int) -> None:
    """Log why the sizes are measured: no cache yet, the data changed, or which settings."""
    how = f"measuring {n} samples with {max(workers, 1)} process(es)"
    try:
        last = json.loads(_pointer(folder, path).read_text())
    except (OSError, ValueError):
        log.info("no cached sizes for %s: %s", path, how)
        return
    why = []
    if last.get("source") != source:
        why.append("the data changed")
    old = last.get("settings", {})
    diff = sorted(k for k in {*old, *settings} if old.get(k) != settings.get(k))
    if diff:
        why.append("encoder settings changed: " + ", ".join(diff))
    log.info("cached sizes of %s do not apply (%s): %s", path,
             "; ".join(why) or "the measuring code changed", how)
