"""Turn Triton's autotuning results for fla's kernels into fla's kernel-configuration files.

    python tools/fla_configs.py TRITON_CACHE_DIR OUT_DIR --triton-version 3.6.0

A run's Triton cache (`OUTPUT_DIR/kernel_cache/triton` with `train.kernel_cache=run`) holds one
`<kernel>.autotune.json` per kernel and autotuning key: the key and every tried configuration's
timings. This writes OUT_DIR/<kernel>.json in the format fla reads under FLA_CONFIG_DIR
(fla/ops/utils/cache.py): `autotune_entries` maps the md5 of the key's compact, sorted JSON to
the key and the fastest configuration. Triton picks the fastest the same way (the smallest
timings list, compared element by element). Kernels that fla autotunes with plain
`triton.autotune` never read these files; they are written all the same and do no harm.
vlpack keeps one folder per GPU in src/vlpack/train/setup/fla_configs/ (train/setup/kernel_cache.py).
Tune with `train.tuned_kernels=false`: a kernel served from kept configurations is not tuned,
so Triton writes no result for it and its entries would be missing here.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

SUFFIX = ".autotune.json"


def key_hash(key: list) -> str:
    """fla's entry name for an autotuning key: md5 of its compact JSON with sorted keys."""
    return hashlib.md5(json.dumps(key, separators=(",", ":"), sort_keys=True).encode()).hexdigest()


def fastest(configs_timings: list) -> dict:
    """The configuration whose timings list is smallest (Triton's choice)."""
    return min(configs_timings, key=lambda ct: ct[1])[0]


def convert(triton_cache: Path, triton_version: str) -> dict[str, dict]:
    """{kernel name: fla's configuration file} from every autotuning result under the cache."""
    files: dict[str, dict] = {}
    for path in sorted(triton_cache.rglob(f"*{SUFFIX}")):
        name = path.name[: -len(SUFFIX)]
        result = json.loads(path.read_text())
        entry = {"autotune_key": result["key"], "config": fastest(result["configs_timings"])}
        out = files.setdefault(name, {"kernel_name": name, "triton_version": triton_version,
                                      "autotune_entries": {}, "default_config": None})
        out["autotune_entries"][key_hash(result["key"])] = entry
    return files


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("triton_cache", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--triton-version", required=True, help="the Triton that measured them")
    args = p.parse_args(argv)
    files = convert(args.triton_cache, args.triton_version)
    if not files:
        raise SystemExit(f"no *{SUFFIX} under {args.triton_cache}: run with FLA_CACHE_RESULTS=1 "
                         "(fla's default) and TRITON_CACHE_DIR pointing there")
    args.out.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (args.out / f"{name}.json").write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    n = sum(len(d["autotune_entries"]) for d in files.values())
    print(f"{len(files)} kernels, {n} keys → {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
