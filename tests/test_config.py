"""Config: validation at construction, YAML 1:1, dotted overrides, every shipped recipe."""

import argparse
import inspect
from pathlib import Path

import pytest

from vlpack.config import (
    Config,
    DataConfig,
    ModelConfig,
    TrainConfig,
    load_config,
    save_config,
)

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))
assert CONFIGS, "the configs/ link to src/vlpack/configs is broken"


def test_defaults_are_valid() -> None:
    cfg = load_config()
    assert isinstance(cfg, Config)
    assert cfg.data.packing == "bfd"


def test_overrides_and_types() -> None:
    cfg = load_config(None, ["train.max_steps=7", "optim.lr=1e-4", "data.max_patches=null",
                             "optim.betas=[0.8, 0.9]", "model.freeze_vision=true",
                             "train.output_dir=runs/x"])
    assert cfg.train.max_steps == 7 and cfg.optim.lr == 1e-4 and cfg.data.max_patches is None
    assert cfg.optim.betas == (0.8, 0.9) and cfg.model.freeze_vision is True
    assert cfg.train.output_dir == "runs/x"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.max_step=3", "did you mean train.max_steps"),
        ("data.packing=zip", "data.packing='zip' is not one of"),
        ("train.max_steps=0", "train.max_steps must be > 0"),
        ("train.max_steps=2.5", "needs an integer"),
        ("data.seq_len=1001", "multiple of data.pad_to_multiple_of"),
        ("data.source=jsonl", "needs data.path"),
        ("data.path=my.jsonl", "add data.source=jsonl"),
        ("nosection=1", "section.key"),
        ("bogus.key=1", "unknown config key 'bogus'"),
    ],
)
def test_bad_values_name_the_key(override: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        load_config(None, [override])


@pytest.mark.parametrize(("section", "key", "choices"), [
    (DataConfig, "source", "jsonl, synthetic, energon, hf"),
    (DataConfig, "packing", "greedy, ffd, bfd, none"),
    (DataConfig, "overlong", "error, truncate, skip"),
    (DataConfig, "mrope_after_video", "qwen, transformers"),
    (ModelConfig, "init", "pretrained, random"),
    (ModelConfig, "compile_scope", "regions, layers"),
    (TrainConfig, "fsdp", "auto, always"),
    (TrainConfig, "reduce_dtype", "float32, bfloat16"),
])
def test_a_section_built_in_code_refuses_a_value_outside_its_choices(section, key,
                                                                      choices) -> None:
    """The choices are the field's `Literal`, read where a section is built (not only when
    YAML or an override is parsed)."""
    prefix = {DataConfig: "data", ModelConfig: "model", TrainConfig: "train"}[section]
    with pytest.raises(ValueError, match=f"^{prefix}.{key}='zip' is not one of {choices}$"):
        section(**{key: "zip"})


def test_plain_constructors_share_the_sections_defaults() -> None:
    """A constructor that mirrors a data field (for tests and tools) takes its default from
    config.py, and the CLI's flags for data fields too: each default lives once."""
    from vlpack.cli import _add_encoder_flags
    from vlpack.data.encode import Encoder

    d = DataConfig()
    sig = inspect.signature(Encoder)
    assert sig.parameters["supervise_empty_think"].default == d.supervise_empty_think
    parser = argparse.ArgumentParser()
    _add_encoder_flags(parser)
    assert parser.parse_args([]).chat_template == d.chat_template


def test_yaml_round_trip(tmp_path: Path) -> None:
    cfg = load_config(None, ["data.seq_len=2048", "optim.betas=[0.8,0.9]"])
    save_config(cfg, tmp_path / "c.yaml")
    assert load_config(tmp_path / "c.yaml") == cfg


def test_yaml_errors_name_the_file(tmp_path: Path) -> None:
    p = tmp_path / "bad.yaml"
    p.write_text("train:\n  max_steps: -1\n")
    with pytest.raises(ValueError, match=r"bad\.yaml"):
        load_config(p)


@pytest.mark.parametrize("text", ["- train:\n    max_steps: 3\n", "just words\n", "42\n"])
def test_yaml_top_level_not_a_mapping_names_the_file(tmp_path: Path, text: str) -> None:
    p = tmp_path / "listed.yaml"
    p.write_text(text)
    with pytest.raises(ValueError, match=r"listed\.yaml: the top level must be a mapping"):
        load_config(p, ["train.max_steps=2"])


def test_shipped_recipes_exist() -> None:
    names = {p.stem for p in CONFIGS}
    for base in ("tiny", "qwen3-vl-2b", "qwen3-vl-8b", "qwen3-vl-30b-a3b", "qwen3.5-9b",
                 "qwen3.5-35b-a3b"):
        assert base in names and f"{base}-nopack" in names, base


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_every_shipped_recipe_loads(path: Path) -> None:
    cfg = load_config(path)
    assert (cfg.data.packing == "none") == path.stem.endswith("-nopack")


def test_recipes_load_by_name() -> None:
    assert load_config("tiny").model.name == "tiny-qwen3_vl"
    with pytest.raises(ValueError, match=r"recipes: .*tiny"):
        load_config("no-such-recipe")
