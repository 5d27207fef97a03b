"""`--help` names what the flags take: presets, recipes, --samples, --seed, --data synth; only
the CLI reads flags."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import vlpack
from vlpack.cli import main
from vlpack.config import RECIPES
from vlpack.model.presets import PRESETS


def _help(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as e:
        main([*argv, "--help"])
    assert e.value.code == 0
    return " ".join(capsys.readouterr().out.split())  # argparse wraps lines


def test_check_help_lists_presets_and_documents_its_flags(capsys) -> None:
    text = _help(capsys, "check")
    assert all(name in text for name in PRESETS), text
    assert "--samples SAMPLES samples packed into the checked row" in text
    assert "--seed SEED seed of the synthetic samples" in text
    assert "synth: the built-in synthetic receipts" in text


def test_help_keeps_preset_names_whole_however_the_list_wraps(capsys, monkeypatch) -> None:
    """argparse wraps the preset list; a name is never split at its hyphens, whatever cut
    presets (`NAME-<n>L`, registered on use) lengthen the list."""
    from vlpack.model import presets

    monkeypatch.setattr(presets, "PRESETS", dict(presets.PRESETS))
    monkeypatch.setenv("COLUMNS", "80")
    for n in range(2, 40):  # each longer list moves every line break
        presets.get_preset(f"qwen3.5-35b-a3b-{n}L")
        for cmd in ("check", "train"):
            text = _help(capsys, cmd)
            assert all(name in text for name in presets.PRESETS), (n, text)


def test_train_help_lists_recipes_and_presets(capsys) -> None:
    text = _help(capsys, "train")
    assert all(p.stem in text for p in RECIPES.glob("*.yaml"))
    assert all(name in text for name in PRESETS)


def test_data_synth_help_documents_seed(capsys) -> None:
    assert "--seed SEED seed of the receipts" in _help(capsys, "data", "synth")


def test_no_module_below_the_cli_reads_flags() -> None:
    """cli.py turns the flags into config sections and typed arguments; no other module of
    vlpack names argparse (the `grep` of issue 35)."""
    root = Path(vlpack.__file__).parent
    readers = {str(p.relative_to(root)) for p in sorted(root.rglob("*.py"))
               if re.search(r"\bargparse\b", p.read_text())}
    assert readers == {"cli.py"}


_HELP = """import runpy, sys
sys.argv = ["vlpack", *sys.argv[1:]]
try:
    runpy.run_module("vlpack", run_name="__main__")
except SystemExit:
    pass
print("heavy:", sorted({"torch", "transformers"} & set(sys.modules)), file=sys.stderr)
"""


@pytest.mark.parametrize("args", [["--help"], ["train", "--help"]])
def test_help_imports_neither_torch_nor_transformers(args: list[str]) -> None:
    """`python3 -m vlpack [train] --help` prints its text (the preset list included) without
    importing torch or transformers, so it answers in well under a second."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _HELP, *args], capture_output=True, text=True,
                          timeout=60, check=True)
    assert done.stdout.startswith(f"usage: vlpack {args[0] if len(args) > 1 else ''}".rstrip())
    assert done.stderr.splitlines()[-1] == "heavy: []"
    if args[0] == "train":
        assert "tiny-qwen3_vl" in done.stdout
