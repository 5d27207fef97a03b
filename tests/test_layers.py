"""The package's layers: model code imports nothing from train/ (whose parallelism imports
torch.distributed); what assembles both lives in train/ or above."""

from __future__ import annotations

import ast
from pathlib import Path

MODEL = Path(__file__).resolve().parents[1] / "src" / "vlpack" / "model"


def _imports(path: Path) -> set[str]:
    """Every module `path` imports, at any depth of its code."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


def test_model_code_imports_nothing_from_train():
    found = {f"{p.name}: {m}" for p in sorted(MODEL.glob("*.py")) for m in _imports(p)
             if m == "vlpack.train" or m.startswith("vlpack.train.")}
    assert not found, sorted(found)


def test_only_the_parallelism_seam_of_model_code_imports_torch_distributed():
    found = sorted(p.name for p in MODEL.glob("*.py")
                   if any(m == "torch.distributed" or m.startswith("torch.distributed.")
                          for m in _imports(p)))
    assert found == ["context.py"], found
