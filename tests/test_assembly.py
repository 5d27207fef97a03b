"""One assembly per thing: vlpack's code and benchmarks build an encoder only through
`Encoder.from_config` (the `data` section, the family, the checkpoint folder), so every
encoder reads its settings the way a training run does."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCANNED = (ROOT / "src" / "vlpack", ROOT / "bench")


def _constructions(path: Path, cls: str) -> list[int]:
    """Lines of `path` that call `cls(...)` (or `module.cls(...)`) directly."""
    return [node.lineno for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Call)
            and ((isinstance(node.func, ast.Name) and node.func.id == cls)
                 or (isinstance(node.func, ast.Attribute) and node.func.attr == cls))]


def test_encoders_are_built_only_through_from_config():
    found = [f"{p.relative_to(ROOT)}:{line}" for root in SCANNED for p in sorted(root.rglob("*.py"))
             for line in _constructions(p, "Encoder")]
    assert not found, f"build these with Encoder.from_config(data_section, family, folder): {found}"


def test_the_scan_sees_a_construction(tmp_path: Path):
    f = tmp_path / "mod.py"
    f.write_text("from vlpack.data import encode\n\nenc = encode.Encoder('qwen3_vl')\n"
                 "other = Encoder.from_config(d, 'qwen3_vl', None)\n")
    assert _constructions(f, "Encoder") == [3]


def test_from_config_builds_what_the_plain_constructor_builds():
    """The defaults of the `data` section are the encoder's own: the same settings, the same
    size-cache key."""
    from vlpack.config import DataConfig
    from vlpack.data.encode import Encoder

    for family in ("qwen2_5_vl", "qwen3_5"):
        assert (Encoder.from_config(DataConfig(max_pixels=200_704), family, None).length_settings()
                == Encoder(family, max_pixels=200_704).length_settings())
