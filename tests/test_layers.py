"""The package's layers: each module imports only from floors below its own (or from its own
part), and no modules import each other round a cycle. Model code imports nothing from train/
(whose parallelism imports torch.distributed); what assembles both lives in train/ or above.
Inside train/ the same rule holds between its folders and top-level modules (`TRAIN_FLOORS`).
Every import counts, function-local ones too."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "vlpack"
MODEL = PACKAGE / "model"

FLOORS = (
    ("families", "pickles"),  # tables and helpers: no other vlpack module
    ("preset_names",),  # the presets' names, for the config's checks
    ("config",),  # the run's settings, validated
    ("config_keys", "data"),  # the config's reference; samples, encoding, packing, loading
    ("model",),  # the model and its kernels (reads data's types)
    ("train",),  # the loop, parallelism, checkpoints: assembles data and model
    ("check",),  # `vlpack check`: builds through train/setup/stack.py, so above train, below the CLI
    ("cli",),  # the commands
    ("__main__",),  # `python -m vlpack`
)
"""The parts of `vlpack` (a top-level module or subpackage), lowest floor first. A part may
import its own modules and those of lower floors; parts on one floor import none of each other."""

TRAIN_FLOORS = (
    ("distributed",),  # the process group, FSDP2, SLURM: no other train module
    ("setup",),  # the model a run trains: memory plan, preparation, the stack
    ("run",),  # what a run writes and reads: checkpoints, export, metrics, the held-out eval
    ("epochs", "optim", "resume", "step"),  # the loop's parts
    ("trainer",),  # the loop
    ("command",),  # `vlpack train`
)
"""The parts of `vlpack.train` (a module of train/ or a folder of it), lowest floor first, by the
same rule as `FLOORS`."""


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


def _modules() -> dict[str, Path]:
    """Dotted name → file of every module of the package (a package by its __init__.py)."""
    out = {}
    for p in sorted(PACKAGE.rglob("*.py")):
        parts = p.relative_to(SRC).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def _graph() -> dict[str, set[str]]:
    """Module → the package's modules it imports (`from a.b import c` is a.b.c when that is a
    module, else a.b; `import a.b.c` is the deepest of those that is a module)."""
    mods = _modules()
    graph = {}
    for m, p in mods.items():
        names = set()
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                names |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods
                          else node.module for a in node.names}
        graph[m] = set()
        for name in names:
            while name and name not in mods:
                name = name.rpartition(".")[0]
            if name and name != m:
                graph[m].add(name)
    return graph


def _part(module: str, depth: int = 1) -> str:
    """The part of `module` at `depth`: 1 for `vlpack`'s parts, 2 for `vlpack.train`'s."""
    parts = module.split(".")
    return parts[depth] if len(parts) > depth else module


def _upward(graph: dict[str, set[str]], floors: tuple[tuple[str, ...], ...], inside: str,
            depth: int) -> list[str]:
    """Every import of a module below `inside` from a part of `inside` on its own floor or above
    (an import of a module outside `inside`, or of `inside` itself, is not counted here)."""
    level = {p: i for i, floor in enumerate(floors) for p in floor}
    below = inside + "."
    return sorted(f"{m} imports {t} (floor {level[_part(t, depth)]} >= {level[_part(m, depth)]})"
                  for m, targets in graph.items() if m.startswith(below) for t in targets
                  if t.startswith(below) and _part(t, depth) != _part(m, depth)
                  and level[_part(t, depth)] >= level[_part(m, depth)])


def test_every_part_of_the_package_has_a_floor():
    floored = {p for floor in FLOORS for p in floor}
    parts = {_part(m) for m in _modules() if m != "vlpack"}
    assert parts <= floored, f"give these a floor in FLOORS: {sorted(parts - floored)}"


def test_every_part_of_train_has_a_floor():
    floored = {p for floor in TRAIN_FLOORS for p in floor}
    parts = {_part(m, 2) for m in _modules() if m.startswith("vlpack.train.")}
    assert parts <= floored, f"give these a floor in TRAIN_FLOORS: {sorted(parts - floored)}"


def test_no_module_imports_from_its_own_floor_or_above():
    found = _upward(_graph(), FLOORS, "vlpack", 1)
    assert not found, found


def test_no_train_module_imports_from_its_own_floor_or_above():
    found = _upward(_graph(), TRAIN_FLOORS, "vlpack.train", 2)
    assert not found, found


def test_the_floor_check_sees_an_upward_import_inside_train():
    """The check itself: the distributed floor importing the trainer is found, and only that."""
    parallel, trainer = "vlpack.train.distributed.parallel", "vlpack.train.trainer"
    graph = {parallel: {"vlpack.train.distributed.slurm", trainer, "vlpack.model.context"},
             trainer: {parallel, "vlpack.train.setup.stack", "vlpack.train.run.checkpoint"}}
    assert _upward(graph, TRAIN_FLOORS, "vlpack.train", 2) == [
        "vlpack.train.distributed.parallel imports vlpack.train.trainer (floor 4 >= 0)"]


def test_no_import_cycle_between_modules():
    graph = _graph()
    cycles, state = [], {}  # state: 1 on the current path, 2 done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                cycles.append(" -> ".join([*path[path.index(t):], t]))
            elif t not in state:
                visit(t, [*path, t])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, cycles


def test_the_layer_check_sees_an_upward_import(tmp_path: Path):
    """The check itself: an import from a higher floor, function-local, is found."""
    f = tmp_path / "mod.py"
    f.write_text("def f():\n    from vlpack.model.presets import get_preset\n")
    assert "vlpack.model.presets.get_preset" in _imports(f)


def test_model_code_imports_nothing_from_train():
    found = {f"{p.name}: {m}" for p in sorted(MODEL.glob("*.py")) for m in _imports(p)
             if m == "vlpack.train" or m.startswith("vlpack.train.")}
    assert not found, sorted(found)


def test_only_the_parallelism_seam_of_model_code_imports_torch_distributed():
    found = sorted(p.name for p in MODEL.glob("*.py")
                   if any(m == "torch.distributed" or m.startswith("torch.distributed.")
                          for m in _imports(p)))
    assert found == ["context.py"], found


def test_no_test_folder_is_one_pytest_skips() -> None:
    """pytest's default `norecursedirs` (build, dist, and names starting with a dot, among
    others) would silently leave a test folder of such a name uncollected."""
    skipped = {"build", "dist", "node_modules", "venv", "CVS", "_darcs", "{arch}"}
    tests = Path(__file__).resolve().parent
    bad = [p for p in tests.rglob("*") if p.is_dir() and (p.name in skipped or p.name.startswith(
        ".") or p.name.endswith(".egg"))]
    assert not bad, f"rename these test folders (pytest does not collect them): {bad}"
