"""`vlpack config`: every key with its value, type, default and docstring from config.py."""

from __future__ import annotations

from vlpack.cli import main
from vlpack.config import load_config
from vlpack.config_keys import config_keys, format_key
from vlpack.train.run.tracking import flatten


def test_every_key_in_order_with_the_runs_value() -> None:
    cfg = load_config("qwen3-vl-8b-lora")
    keys = config_keys(cfg)
    plain = flatten(cfg.to_dict())  # the run's config.yaml, flattened
    assert [k.name for k in keys] == list(plain)
    assert {k.name: k.value for k in keys} == plain


def test_one_key_literal() -> None:
    keys = {k.name: k for k in config_keys(load_config("tiny", ["train.log_every=5"]))}
    assert format_key(keys["train.log_every"]) == (
        "train.log_every = 5  (int, default 1)\n"
        "    Write a metrics row (and, when stderr is not a terminal, a progress line) every N steps.")
    assert format_key(keys["model.lora.rank"]) == "model.lora.rank = 0  (int)"  # no docstring
    assert format_key(keys["train.report_to"]).startswith(
        "train.report_to = []  (list[Literal['tensorboard', 'wandb', 'mlflow', 'trackio']])\n"
        "    Experiment trackers that mirror every metrics row on rank 0")


def test_cli_lists_the_keys_of_a_recipe_with_overrides(capsys) -> None:
    assert main(["config", "tiny", "optim.lr=0.5", "--key", "optim.lr"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("optim.lr = 0.5  (float | None, default None)\n    None: 1e-5 for full")
    assert "\n\noptim.lr_vision = None  (float | None)\n" in out
    assert main(["config", "train.seed=3", "--key", "train.seed"]) == 0
    assert capsys.readouterr().out == "train.seed = 3  (int, default 0)\n"
