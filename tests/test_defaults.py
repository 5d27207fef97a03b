"""One default per setting: a function of vlpack or its benchmarks that takes a parameter named
like a field of a config section (config.py) either has no default (the caller passes the
section's value), takes the section's own (`default_of(Section, "name")`), or means something
else and says so with a name of its own. A parameter default of None is "not given" (a process
rank, no length check, the section's value looked up by the function) and is not compared."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path
from typing import Any

import vlpack.config as config

ROOT = Path(__file__).resolve().parents[1]
SCANNED = (ROOT / "src" / "vlpack", ROOT / "bench")

ALLOWED: set[tuple[str, str, str]] = set()
"""(file, function, parameter) whose default may differ from the config field of its name,
each with a comment saying why; none today."""
MISSING = object()


def config_defaults() -> dict[str, list[tuple[str, Any]]]:
    """Field name → (section, default) of every dataclass field in config.py."""
    out: dict[str, list[tuple[str, Any]]] = {}
    for cls in vars(config).values():
        if isinstance(cls, type) and dataclasses.is_dataclass(cls) and cls.__module__ == config.__name__:
            for f in dataclasses.fields(cls):
                out.setdefault(f.name, []).append((cls.__name__, config.default_of(cls, f.name)))
    return out


def _agrees(node: ast.expr, name: str, defaults: list[tuple[str, Any]]) -> bool:
    """Whether the default `node` of the parameter `name` is the config's."""
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id == "default_of"):
        return True  # the section's own default
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
            and node.value.id == "torch":
        return any(d == node.attr for _, d in defaults)  # torch.float32 for "float32"
    try:
        value = ast.literal_eval(node)
    except ValueError:
        return False  # an expression: no way to tell, so take default_of or none
    return any(type(value) is type(d) and value == d for _, d in defaults)


def _parameter_defaults(fn: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda
                        ) -> list[tuple[ast.arg, ast.expr]]:
    """(parameter, default) of each parameter of `fn` that has a default."""
    a = fn.args
    positional = a.posonlyargs + a.args
    return [*zip(positional[len(positional) - len(a.defaults):], a.defaults, strict=True),
            *((k, d) for k, d in zip(a.kwonlyargs, a.kw_defaults, strict=True) if d is not None)]


def offenders(paths: list[Path]) -> list[str]:
    """`file:line function name=default vs Section default` for each disagreeing parameter."""
    fields = config_defaults()
    found = []
    for path in paths:
        rel = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)
        if rel == "src/vlpack/config.py":
            continue
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                continue
            name_of = getattr(fn, "name", "<lambda>")
            for arg, default in _parameter_defaults(fn):
                defaults = fields.get(arg.arg)
                if (defaults is None or (rel, name_of, arg.arg) in ALLOWED
                        or (isinstance(default, ast.Constant) and default.value is None)
                        or _agrees(default, arg.arg, defaults)):
                    continue
                config_side = ", ".join(f"{s}.{arg.arg}={d!r}" for s, d in defaults)
                found.append(f"{rel}:{default.lineno} {name_of}({arg.arg}="
                             f"{ast.unparse(default)}) vs config {config_side}")
    return found


def _sources() -> list[Path]:
    return [p for root in SCANNED for p in sorted(root.rglob("*.py"))]


def test_no_parameter_holds_a_second_default_for_a_config_field():
    found = offenders(_sources())
    assert not found, ("make these required, take the section (or default_of), or give the "
                       "parameter a name of its own:\n" + "\n".join(found))


def test_the_allowed_defaults_still_differ():
    """An allowance whose function, parameter or difference is gone is dropped."""
    seen = set()
    fields = config_defaults()
    for rel, fn_name, arg in ALLOWED:
        for fn in ast.walk(ast.parse((ROOT / rel).read_text())):
            if isinstance(fn, ast.FunctionDef) and fn.name == fn_name:
                if any(p.arg == arg and not _agrees(d, arg, fields[arg])
                       for p, d in _parameter_defaults(fn)):
                    seen.add((rel, fn_name, arg))
    assert seen == ALLOWED, sorted(ALLOWED - seen)


def test_the_scan_finds_a_planted_default(tmp_path: Path):
    f = tmp_path / "mod.py"
    f.write_text("def a(*, seq_len=2048, packing='bfd', pad_to_multiple_of=None):\n    pass\n\n"
                 "def b(grad_clip=default_of(OptimConfig, 'grad_clip'), reduce_dtype=torch.bfloat16):\n"
                 "    pass\n")
    found = offenders([f])
    assert len(found) == 2, found
    assert "a(seq_len=2048) vs config DataConfig.seq_len=4096" in found[0]
    assert "b(reduce_dtype=torch.bfloat16)" in found[1]
