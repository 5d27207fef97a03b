"""`vlpack config [RECIPE] [key=value ...]`: every config key with its value in that run, its
type, its default and its docstring, read from the dataclasses in `config.py` (the string under
a field is its docstring).

One key, as printed::

    train.log_every = 5  (int, default 1)
        Write a metrics row (and, when stderr is not a terminal, a progress line) every N steps.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
from dataclasses import dataclass
from functools import cache
from typing import Any

from vlpack.config import Config


@dataclass(frozen=True, slots=True)
class Key:
    """One leaf config key."""

    name: str
    """Dotted, e.g. `optim.lr`."""
    type: str
    """The annotation as written in config.py."""
    default: Any
    value: Any
    doc: str


@cache
def _annotations_and_docs(cls: type) -> dict[str, tuple[str, str]]:
    """field -> (annotation source, docstring or "") from the class's source."""
    node = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
    assert isinstance(node, ast.ClassDef)
    out: dict[str, tuple[str, str]] = {}
    for stmt, nxt in zip(node.body, [*node.body[1:], None], strict=True):
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            doc = ""
            if (isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)):
                doc = inspect.cleandoc(nxt.value.value)
            out[stmt.target.id] = (ast.unparse(stmt.annotation), doc)
    return out


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory()  # type: ignore[misc]


def config_keys(cfg: Config) -> list[Key]:
    """Every leaf key of `cfg` in declaration order (nested sections such as model.lora
    flattened), with `cfg`'s value beside the dataclass default."""
    keys: list[Key] = []

    def walk(obj: Any, prefix: str) -> None:
        meta = _annotations_and_docs(type(obj))
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value):
                walk(value, f"{prefix}{f.name}.")
                continue
            annotation, doc = meta[f.name]
            keys.append(Key(f"{prefix}{f.name}", annotation, _plain(_default(f)), _plain(value), doc))

    walk(cfg, "")
    return keys


def _plain(v: Any) -> Any:
    if dataclasses.is_dataclass(v):
        return dataclasses.asdict(v)
    if isinstance(v, tuple):
        return list(v)
    if isinstance(v, list):
        return [_plain(x) for x in v]
    return v


def format_key(k: Key) -> str:
    """`name = value  (type, default D)` (`default` only when it differs), then the docstring
    indented by four spaces."""
    default = "" if k.value == k.default else f", default {k.default!r}"
    head = f"{k.name} = {k.value!r}  ({k.type}{default})"
    return head + "".join(f"\n    {line}" if line else "\n" for line in k.doc.splitlines())


def format_config(cfg: Config, *, prefix: str | None = None) -> str:
    """Every key of `cfg` as `format_key` prints it (only those starting with `prefix`, when
    given), a blank line apart; ValueError naming the sections when no key starts with it."""
    keys = config_keys(cfg)
    if prefix:
        keys = [k for k in keys if k.name.startswith(prefix)]
        if not keys:
            raise ValueError(f"no config key starts with {prefix!r}: sections are data, model, "
                             "optim, train, parallel")
    return "\n\n".join(format_key(k) for k in keys)
