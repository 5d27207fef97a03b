"""The commands the docs cite run as written: plain `bench/*.py` scripts with flags those scripts
define and `vlpack train` overrides that name config fields; none goes through the remote-machine
harness (tools/h200_session.sh). Read from the files, without running anything."""

from __future__ import annotations

import ast
import json
import re
from functools import cache
from pathlib import Path

import pytest

from vlpack.config import config_from_dict

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "docs").rglob("*.json")])
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
SPAN = re.compile(r"`([^`]+)`")
SCRIPT = re.compile(r"(?:^|/)bench/(\w+)\.py$")
FLAG = re.compile(r"^[{\[(]*(--[a-z][a-z0-9-]*)")
OVERRIDE = re.compile(r"^'?([a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)+)=")
STOP = {"#", ";", "&&", "then", "python", "python3", "torchrun", "vlpack"}


def commands(text: str, *, is_json: bool = False) -> list[str]:
    """Command-like spans: fenced lines (`\\` continuations joined) and inline code spans of a
    markdown text; a JSON file's strings (their code spans where they have any)."""
    if is_json:
        out: list[str] = []

        def walk(o: object) -> None:
            if isinstance(o, dict):
                o = list(o.values())
            if isinstance(o, list):
                for v in o:
                    walk(v)
            elif isinstance(o, str):
                out.extend(SPAN.findall(o) or [o])

        walk(json.loads(text))
        return out
    out = []
    for block in FENCE.findall(text):
        out += [line for line in block.replace("\\\n", " ").splitlines() if line.strip()]
    prose = FENCE.sub("", text)
    return out + [" ".join(s.split()) for s in SPAN.findall(prose)]


def bench_calls(cmd: str) -> list[tuple[str, list[str]]]:
    """(script name, flags) of every `bench/NAME.py` in a command, flags up to the next command."""
    calls: list[tuple[str, list[str]]] = []
    for tok in cmd.split():
        m = SCRIPT.search(tok)
        if m:
            calls.append((m.group(1), []))
        elif calls and (tok in STOP or tok.startswith("PYTHONPATH=")):
            calls.append(("", []))  # the call ended; later flags are not its own
        elif calls and (f := FLAG.match(tok)):
            calls[-1][1].append(f.group(1))
    return [c for c in calls if c[0]]


def train_overrides(cmd: str) -> list[str]:
    """The `section.key` of every override after `vlpack train` in a command."""
    m = re.search(r"vlpack train\b(.*)", cmd)
    if not m:
        return []
    keys = []
    for tok in m.group(1).split():
        if tok in STOP or tok == "|":
            break
        if o := OVERRIDE.match(tok):
            keys.append(o.group(1))
    return keys


@cache
def script_flags(name: str) -> frozenset[str]:
    """The option strings `bench/NAME.py` passes to argparse's add_argument."""
    flags = {"-h", "--help"}
    for node in ast.walk(ast.parse((ROOT / "bench" / f"{name}.py").read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
            opts = [a.value for a in node.args
                    if isinstance(a, ast.Constant) and str(a.value).startswith("-")]
            flags.update(opts)
            if any(k.arg == "action" and "BooleanOptional" in ast.unparse(k.value) for k in node.keywords):
                flags.update("--no-" + o[2:] for o in opts if o.startswith("--"))
    return frozenset(flags)


def config_has(key: str) -> bool:
    """Whether `section.key` (nested: `model.lora.rank`) names a field of the config."""
    obj: object = config_from_dict({})
    for part in key.split("."):
        if not hasattr(obj, "__dataclass_fields__") or part not in obj.__dataclass_fields__:
            return False
        obj = getattr(obj, part)
    return True


def _all_commands() -> list[tuple[str, str]]:
    return [(str(p.relative_to(ROOT)), c) for p in DOCS
            for c in commands(p.read_text(), is_json=p.suffix == ".json")]


def test_extraction_on_literal_markdown() -> None:
    text = ("Run `python3 bench/a.py --x 1\n--y` or:\n\n```bash\npython3 bench/b.py --z \\\n  --w  # --not\n"
            "PYTHONPATH=<site> python3 bench/a.py --v; vlpack train tiny train.max_steps=3 'data.seq_len=8'\n"
            "```\n")
    cmds = commands(text)
    assert [bench_calls(c) for c in cmds] == [
        [("b", ["--z", "--w"])], [("a", ["--v"])], [("a", ["--x", "--y"])]]
    assert train_overrides(cmds[1]) == ["train.max_steps", "data.seq_len"]
    assert commands(json.dumps({"r": {"command": "python3 bench/c.py --q", "m": "x (`bench/d.py --r`) --s"}}),
                    is_json=True) == ["python3 bench/c.py --q", "bench/d.py --r"]


def test_no_doc_cites_the_remote_machine_harness() -> None:
    cited = [str(p.relative_to(ROOT)) for p in DOCS if "h200_session" in p.read_text()]
    assert not cited, f"{cited}: cite the plain bench/*.py, vlpack train or torchrun command instead"


def test_cited_bench_scripts_and_flags_exist() -> None:
    calls = [(where, name, flags) for where, c in _all_commands() for name, flags in bench_calls(c)]
    assert len(calls) > 40  # the extraction finds the benchmarks' commands
    bad = [f"{where}: bench/{name}.py {flag}" for where, name, flags in calls
           for flag in (flags if (ROOT / "bench" / f"{name}.py").is_file() else ["(no such script)"])
           if flag == "(no such script)" or flag not in script_flags(name)]
    assert not bad, "docs cite scripts or flags that do not exist:\n" + "\n".join(bad)


@pytest.mark.parametrize("key", ["train.max_steps", "model.lora.rank", "parallel.cp"])
def test_config_has_resolves_nested_fields(key: str) -> None:
    assert config_has(key) and not config_has(key + "x")


def test_cited_train_overrides_name_config_fields() -> None:
    cited = [(where, k) for where, c in _all_commands() for k in train_overrides(c)]
    assert len(cited) > 40
    bad = [f"{where}: {k}" for where, k in cited if not config_has(k)]
    assert not bad, "docs cite vlpack train overrides that are no config field:\n" + "\n".join(bad)


def test_cited_recipes_exist() -> None:
    from vlpack.config import RECIPES

    cited = [(where, m.group(1)) for where, c in _all_commands()
             if (m := re.search(r"vlpack train\s+([a-z0-9][\w.-]*)(?:\s|$)", c)) and "=" not in m.group(1)
             and not m.group(1).endswith(".yaml")]
    assert len(cited) > 10
    bad = [f"{where}: {name}" for where, name in cited if not (RECIPES / f"{name}.yaml").is_file()]
    assert not bad, "docs cite recipes that do not exist:\n" + "\n".join(bad)


LINK = re.compile(r"\]\(([^)\s]+)\)")


def _slugs(md: Path) -> set[str]:
    """The anchors GitHub gives `md`'s headings (lower case, punctuation dropped, spaces to
    hyphens, a repeated heading numbered)."""
    seen: dict[str, int] = {}
    for line in FENCE.sub("", md.read_text()).splitlines():
        if m := re.match(r"^#{1,6} (.+)$", line):
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            if n:
                slug = f"{slug}-{n}"
            seen.setdefault(slug, 1)
    return set(seen)


def test_relative_links_and_anchors_resolve() -> None:
    """Every relative link of a markdown doc names a file of the tree and, with `#anchor`, a
    heading of that file."""
    broken = []
    for md in (d for d in DOCS if d.suffix == ".md"):
        for target in LINK.findall(FENCE.sub("", md.read_text())):
            if re.match(r"^[a-z]+:", target):
                continue  # http(s):, mailto:
            path, _, anchor = target.partition("#")
            dest = (md.parent / path).resolve() if path else md
            if not dest.exists():
                broken.append(f"{md.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _slugs(dest):
                broken.append(f"{md.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_slugs_on_literal_headings(tmp_path) -> None:
    md = tmp_path / "x.md"
    md.write_text("# qwen3.5-35b-a3b-lora as shipped\n## Keeping layers: `model.checkpoint_share=auto`\n"
                  "## Notes\n## Notes\n```\n# not a heading\n```\n")
    assert _slugs(md) == {"qwen35-35b-a3b-lora-as-shipped", "keeping-layers-modelcheckpoint_shareauto",
                          "notes", "notes-1"}
