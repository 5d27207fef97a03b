"""The one check of an Energon dataset folder before Energon reads it (`validate_dataset_folder`).

A dataset folder is untrusted input, and Energon's metadata can run code: a `dataset.yaml`
names the class Energon imports and instantiates (`__module__`/`__class__`/`__function__`, in
any nested mapping), and `sample_loader: FILE.py:fn` / `part_filter: FILE.py:fn` make it compile
and run `.nv-meta/FILE.py`. Split and info files name the shards Energon opens, joined to the
folder as given. So vlpack accepts only what `vlpack data energon-prepare` writes:

- `.nv-meta/dataset.yaml`: `__module__: megatron.energon`, `__class__: CrudeWebdataset` and
  optionally `subflavors` (plain values only);
- `.nv-meta/split.yaml` (or `split.json` when it is absent): `split_parts` (part → shard names)
  and optionally `exclude`;
- `.nv-meta/.info.json` (or `.info.yaml` when it is absent): `shard_counts` (shard name →
  samples) and optionally `energon_version`;

with no `__...__`, `sample_loader` or `part_filter` key anywhere, and every shard (brace
patterns expanded as Energon does), its `.idx` and every metadata file resolving (through `..`
and symlinks) inside the folder. YAML is checked as both PyYAML (`safe_load`) and Energon's own
parser read it, so the two cannot disagree about what the file says.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

META = ".nv-meta"
ACCEPTED_CLASS = {"__module__": "megatron.energon", "__class__": "CrudeWebdataset"}
"""The dataset class `energon-prepare` declares; the only one vlpack hands to Energon."""
DATASET_KEYS = {"__module__", "__class__", "subflavors"}
SPLIT_KEYS = {"split_parts", "exclude"}
INFO_KEYS = {"energon_version", "shard_counts"}
HOOK_KEYS = {"sample_loader", "part_filter"}
"""Keys that make Energon load a Python file from the folder (besides any `__...__` key)."""
FIX = "re-run `vlpack data energon-prepare DATA.jsonl DIR` and train on DIR"


def validate_dataset_folder(path: str | Path) -> Path:
    """The folder `path`, resolved, once its `.nv-meta` holds only what `energon-prepare` writes
    and every shard it names lies inside it; ValueError naming the file and the fix otherwise."""
    given = Path(path)
    if not (given / META / "dataset.yaml").is_file():
        raise ValueError(f"{given} is not a prepared Energon dataset (no {META}/dataset.yaml): "
                         "run `vlpack data energon-prepare DATA.jsonl DIR` and pass DIR")
    root = given.resolve()
    meta = root / META
    for name in ("index.sqlite", "index.uuid"):
        if (meta / name).exists() or (meta / name).is_symlink():
            _inside(root, meta / name, str(meta / name))

    dataset = meta / "dataset.yaml"
    for doc in _parses(root, dataset):
        _check_dataset(dataset, doc)

    split = _first(meta, "split.yaml", "split.json", "Energon's split")
    for doc in _parses(root, split):
        _no_hooks(split, doc)
        parts = _check_keys(split, doc, SPLIT_KEYS, required="split_parts")["split_parts"]
        if not isinstance(parts, dict) or not all(isinstance(v, list) for v in parts.values()):
            raise ValueError(f"{split}: split_parts must map each part to a list of shard "
                             f"names: {FIX}")
        for names in parts.values():
            for name in names:
                _check_shard(root, split, name, _braceexpand(split, name))

    info = _first(meta, ".info.json", ".info.yaml", "Energon's shard list")
    for doc in _parses(root, info):
        _no_hooks(info, doc)
        counts = _check_keys(info, doc, INFO_KEYS, required="shard_counts")["shard_counts"]
        if not isinstance(counts, dict):
            raise ValueError(f"{info}: shard_counts must map shard names to sample counts: {FIX}")
        for name in counts:
            _check_shard(root, info, name, [name])  # Energon uses these names verbatim
    return root


def _first(meta: Path, preferred: str, fallback: str, what: str) -> Path:
    """The file Energon reads: `preferred` when present, else `fallback`; ValueError naming
    both (`what`: what the file holds) when neither is."""
    for name in (preferred, fallback):
        if (meta / name).exists() or (meta / name).is_symlink():
            return meta / name
    raise ValueError(f"{meta}: no {preferred} or {fallback} ({what}): {FIX}")


def _parses(root: Path, file: Path) -> list[Any]:
    """`file` parsed as Energon reads it (json, or its rapidyaml loader) and, for YAML, as
    `yaml.safe_load` reads it; ValueError naming the file when it does not parse."""
    _inside(root, file, str(file))
    try:
        raw = file.read_bytes()
        if file.suffix == ".json":
            return [json.loads(raw)]
        import yaml
        from megatron.energon.eyaml import load_yaml

        return [yaml.safe_load(raw), load_yaml(raw)]
    except Exception as e:  # OSError, yaml's and ryml's parse errors, bad UTF-8
        raise ValueError(f"{file} cannot be read as Energon metadata ({type(e).__name__}: "
                         f"{e}): {FIX}") from None


def _check_keys(file: Path, doc: Any, allowed: set[str], *, required: str) -> dict:
    """`doc` as a mapping with `required` and no key outside `allowed`."""
    if not isinstance(doc, dict) or required not in doc:
        raise ValueError(f"{file} must be a mapping with {required!r} (as energon-prepare writes "
                         f"it): {FIX}")
    extra = sorted(str(k) for k in doc if k not in allowed)
    if extra:
        raise ValueError(f"{file}: key(s) {', '.join(extra)} not accepted (vlpack reads only "
                         f"{', '.join(sorted(allowed))}): remove them, or {FIX}")
    return doc


def _check_dataset(file: Path, doc: Any) -> None:
    """`doc` declares exactly `CrudeWebdataset`, with plain `subflavors` at most."""
    if not isinstance(doc, dict):
        raise ValueError(f"{file} must be a mapping: {FIX}")
    hooks = sorted(str(k) for k in doc if k in HOOK_KEYS or (
        isinstance(k, str) and k.startswith("__") and k.endswith("__") and k not in ACCEPTED_CLASS))
    if hooks:
        raise ValueError(
            f"{file}: {', '.join(hooks)} would make Energon import or run code named by the "
            "dataset, which vlpack refuses (it accepts only __module__: megatron.energon, "
            f"__class__: CrudeWebdataset and subflavors): remove the key(s), or {FIX}")
    declared = {k: doc.get(k) for k in ACCEPTED_CLASS}
    if declared != ACCEPTED_CLASS:
        raise ValueError(
            f"{file} declares __module__: {declared['__module__']}, __class__: "
            f"{declared['__class__']}; vlpack accepts only __module__: megatron.energon, "
            f"__class__: CrudeWebdataset (what energon-prepare writes): {FIX}")
    _check_keys(file, doc, DATASET_KEYS, required="__class__")
    subflavors = doc.get("subflavors")
    if subflavors is not None and not isinstance(subflavors, dict):
        raise ValueError(f"{file}: subflavors must be a mapping: remove it, or {FIX}")
    _no_hooks(file, subflavors)


def _no_hooks(file: Path, node: Any, where: str = "") -> None:
    """No `__...__`, `sample_loader` or `part_filter` key anywhere in `node`."""
    items: Iterable[tuple[Any, Any]] = (
        node.items() if isinstance(node, dict)
        else enumerate(node) if isinstance(node, list) else ()
    )
    for k, v in items:
        at = f"{where}.{k}" if where else str(k)
        if isinstance(node, dict) and isinstance(k, str) and (
                k in HOOK_KEYS or (k.startswith("__") and k.endswith("__"))):
            raise ValueError(
                f"{file}: key {at!r} makes Energon import or run code named by the dataset, "
                f"which vlpack refuses: remove it, or {FIX}")
        _no_hooks(file, v, at)


def _braceexpand(file: Path, name: Any) -> Iterator[str]:
    """The shard names a split entry stands for, expanded as Energon expands them."""
    import braceexpand

    if not isinstance(name, str):
        raise ValueError(f"{file}: shard entry {name!r} is not a file name: {FIX}")
    return braceexpand.braceexpand(name)


def _check_shard(root: Path, file: Path, entry: Any, names: Iterable[str]) -> None:
    """Every shard `names` (from `entry` of `file`) and its `.idx` resolve inside `root`."""
    for name in names:
        if not isinstance(name, str) or not name:
            raise ValueError(f"{file}: shard entry {entry!r} is not a file name: {FIX}")
        what = f"shard {name!r}{f' (entry {entry!r})' if entry != name else ''} of {file}"
        shard = root / name
        _inside(root, shard, what)
        idx = Path(f"{shard}.idx")
        if idx.exists() or idx.is_symlink():
            _inside(root, idx, f"the index of {what}")


def _inside(root: Path, path: Path, what: str) -> None:
    """ValueError naming `what` (a file, or a shard and the file naming it) when `path`
    resolves outside `root`."""
    try:
        real = path.resolve()
    except (ValueError, OSError, RuntimeError) as e:  # a NUL byte, a symlink loop
        raise ValueError(f"{what} is not a usable path ({e}): {FIX}") from None
    if not real.is_relative_to(root):
        raise ValueError(
            f"{what} resolves to {real}, outside the dataset folder {root}: vlpack reads only "
            f"files inside it; name shards by their path inside the folder, or {FIX}")
