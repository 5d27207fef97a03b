"""Sample sizes measured once, in parallel, and cached on disk.

`sample_sizes(items, encoder, path)` returns what `loader.measure_all` returns — each sample's
`SampleSize`, or the `BadSampleError` of a bad one — as a compact `SizeIndex` (12 bytes per good
sample). The sizes are stored in `$VLPACK_CACHE/sizes/` (default `~/.cache/vlpack`) under a key
made of:

- the source's content: a data file's byte count and a BLAKE2b hash of all its bytes (a copy or a
  `touch` keeps the cache, any changed byte re-measures; hashing costs about a second per GB,
  far less than parsing it); a folder (a Hugging Face dataset) by each file's name, byte count
  and modification time (its image bytes can be many GB, too many to hash at each start);
- every attribute of the encoder (`Encoder.length_settings`: family, tokenizer content, chat
  template, pixel bounds, video settings, think supervision, ...), so a new encoder setting is
  part of the key without anyone adding it here;
- the source code of `vlpack.data` (a changed measuring rule re-measures) and `FORMAT`.

Each sample's record holds the byte count and modification time of every media file it names
(images, video files, frames): a sample whose media changed is measured again at the next start
(only that sample). Images a dataset holds as bytes are covered by the source's fingerprint.
Bad samples are judged again at every start (they are few, and their messages name the file and
media paths of this start, which a copy of the data in another folder does not share).

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
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, is_dataclass
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from vlpack.data.types import BadSampleError, Conversation, ImageRef, SampleSize, VideoRef

FORMAT = 1
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
    if os.environ.get("VLPACK_SIZE_CACHE", "").lower() in ("0", "off", "false", "no"):
        return None
    root = Path(os.environ.get("VLPACK_CACHE", Path.home() / ".cache" / "vlpack"))
    return root / "sizes"


def source_fingerprint(path: str | Path) -> str:
    """The content fingerprint of a data file (byte count + BLAKE2b of its bytes) or of a
    folder (each file's relative name, byte count and modification time)."""
    p = Path(path)
    h = hashlib.blake2b(digest_size=16)
    if p.is_dir():
        for f in sorted(q for q in p.rglob("*") if q.is_file()):
            st = f.stat()
            h.update(f"{f.relative_to(p)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        return "dir-" + h.hexdigest()
    with open(p, "rb") as fh:
        while block := fh.read(1 << 20):
            h.update(block)
    return f"{p.stat().st_size}-{h.hexdigest()}"


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


def media_stamps(item) -> list[int]:
    """(byte count, modification time ns) of every media file `item` names, flattened; -1, -1
    for a missing one; nothing for images held as bytes or for a bad record."""
    if not isinstance(item, Conversation):
        return []
    files: list[Path] = []
    for v in item.visuals:
        if isinstance(v, ImageRef):
            if v.data is None:
                files.append(v.path)
        elif isinstance(v, VideoRef):
            files.extend([v.path] if v.path is not None else v.frames)
    out: list[int] = []
    for f in files:
        try:
            st = os.stat(f)
            out += [st.st_size, st.st_mtime_ns]
        except OSError:
            out += [-1, -1]
    return out


@dataclass(slots=True)
class _Part:
    """Sizes of samples lo..hi and their media stamps (what a worker sends back)."""

    lo: int
    sizes: np.ndarray
    errors: dict[int, tuple[str, str]] = field(default_factory=dict)
    stamps: list[list[int]] = field(default_factory=list)


def measure_one(item, encoder) -> SizeOrError:
    """One sample's size, or its error located at its `file:line`."""
    from vlpack.data.loader import located

    if isinstance(item, BadSampleError):
        return item
    try:
        return encoder.measure(item)
    except BadSampleError as e:
        return located(e, item)


def _measure_range(items, encoder, lo: int, hi: int) -> _Part:
    part = _Part(lo, np.full((3, hi - lo), -1, dtype=np.int32))
    for j in range(lo, hi):
        item = items[j]
        s = measure_one(item, encoder)
        if isinstance(s, BadSampleError):
            part.errors[j] = (s.reason, str(s))
        else:
            part.sizes[:, j - lo] = (s.tokens, s.patches, s.video_patches)
        part.stamps.append(media_stamps(item))
    return part


_FORKED: tuple | None = None
"""(items, encoder) that forked workers inherit."""


def _work(span: tuple[int, int]) -> _Part:
    items, encoder = _FORKED
    return _measure_range(items, encoder, *span)


def measure_parallel(items: Sequence, encoder, indices: Sequence[int] | None = None, *,
                     workers: int = 0, progress: bool = False) -> list[_Part]:
    """Parts covering `indices` (default: all), measured in `workers` forked processes (0 or 1:
    in this one). Parts are contiguous runs, in order."""
    idx = np.arange(len(items)) if indices is None else np.asarray(indices, dtype=np.int64)
    runs = _runs(idx, chunk=max(64, -(-len(idx) // max(1, workers * 16))))
    bar = tqdm(total=len(idx), desc="measuring samples", disable=not progress, unit="sample")
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
    index: SizeIndex
    stamps_off: np.ndarray  # [n + 1] int64: sample i's stamps are stamps[off[i]:off[i+1]]
    stamps: np.ndarray  # int64


def _assemble(n: int, parts: list[_Part], base: _Cached | None = None) -> _Cached:
    """A full record from measured parts, over `base` for the samples they do not cover."""
    if base is not None:
        arr = np.stack([base.index.tokens, base.index.patches, base.index.video_patches]).copy()
        errs = {i: (e.reason, str(e)) for i, e in base.index.errors.items()}
        per = [base.stamps[base.stamps_off[i]:base.stamps_off[i + 1]].tolist() for i in range(n)]
    else:
        arr, errs, per = np.full((3, n), -1, dtype=np.int32), {}, [[] for _ in range(n)]
    for p in parts:
        hi = p.lo + p.sizes.shape[1]
        arr[:, p.lo:hi] = p.sizes
        for i in range(p.lo, hi):
            errs.pop(i, None)
        errs.update(p.errors)
        per[p.lo:hi] = p.stamps
    off = np.zeros(n + 1, dtype=np.int64)
    off[1:] = np.cumsum([len(s) for s in per])
    flat = np.fromiter((x for s in per for x in s), dtype=np.int64, count=int(off[-1]))
    errors = {i: BadSampleError(r, m) for i, (r, m) in errs.items()}
    return _Cached(SizeIndex(arr[0], arr[1], arr[2], errors), off, flat)


def _save(file: Path, rec: _Cached, meta: dict) -> None:
    file.parent.mkdir(parents=True, exist_ok=True)
    tmp = file.with_name(f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}.npz")
    errors = [[i, e.reason, str(e)] for i, e in sorted(rec.index.errors.items())]
    ix = rec.index
    np.savez(tmp, tokens=ix.tokens, patches=ix.patches, video_patches=ix.video_patches,
             stamps_off=rec.stamps_off, stamps=rec.stamps,
             meta=np.array(json.dumps({**meta, "errors": errors})))
    os.replace(tmp, file)


def _load(file: Path, n: int) -> _Cached | None:
    try:
        with np.load(file, allow_pickle=False) as z:
            meta = json.loads(str(z["meta"]))
            index = SizeIndex(z["tokens"], z["patches"], z["video_patches"],
                              {i: BadSampleError(r, m) for i, r, m in meta["errors"]})
            rec = _Cached(index, z["stamps_off"], z["stamps"])
    except (OSError, ValueError, KeyError) as e:
        log.warning("size cache %s is unreadable (%s): measuring again", file, e)
        return None
    return rec if len(index) == n else None


# ------------------------------------------------------------------ the entry point


def local_rank(rank: int) -> int:
    """This process's rank on its node: torchrun's LOCAL_RANK, SLURM's SLURM_LOCALID, else
    `rank`."""
    return int(os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", rank)))


def sample_sizes(items: Sequence, encoder, path: str | Path | None, *, workers: int = 0,
                 rank: int = 0, progress: bool = False, media_root: str | None = None
                 ) -> SizeIndex:
    """Every sample's size or error (as `loader.measure_all`), from the cache when it holds
    them for this source content, `media_root` and these encoder settings, else measured with
    `workers` processes and stored. Off the node's first process, waits for that process's
    file."""
    folder = cache_dir()
    if folder is None or path is None or not hasattr(encoder, "length_settings"):
        return SizeIndex.of([p for part in measure_parallel(items, encoder, workers=workers,
                                                            progress=progress)
                             for p in _part_sizes(part)])
    settings = {**encoder.length_settings(), "data.media_root": media_root}
    source = source_fingerprint(path)
    file = folder / f"{source[-32:]}-{settings_key(settings)}.npz"
    measurer = local_rank(rank) == 0
    if not measurer:
        _wait_for(file)
    try:
        return _read_or_measure(items, encoder, path, folder, file, source, settings,
                                workers=workers, progress=progress, write=measurer)
    except BaseException as e:
        if measurer and _job() is not None:  # the waiting ranks stop now, not at the timeout
            file.parent.mkdir(parents=True, exist_ok=True)
            _failed(file).write_text(json.dumps({"job": _job(), "error": repr(e)}))
        raise


def _read_or_measure(items: Sequence, encoder, path, folder: Path, file: Path, source: str,
                     settings: dict, *, workers: int, progress: bool, write: bool) -> SizeIndex:
    n = len(items)
    rec = _load(file, n) if file.is_file() else None
    if rec is None:
        _say_why(folder, path, source, settings, n, workers)
        rec = _assemble(n, measure_parallel(items, encoder, workers=workers, progress=progress))
    else:
        # A bad sample is judged again: its message names the file it was read from and the
        # media it resolved, which differ for the same bytes in another folder.
        changed = [i for i in range(n) if i in rec.index.errors or media_stamps(items[i])
                   != rec.stamps[rec.stamps_off[i]:rec.stamps_off[i + 1]].tolist()]
        if not changed:
            log.info("sizes of %d samples of %s read from %s", n, path, file)
            return rec.index
        log.info("sizes of %s read from %s; %d of %d samples were bad or name media that "
                 "changed since: measuring those again", path, file, len(changed), n)
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
