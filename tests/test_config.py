"""Config: validation at construction, YAML 1:1, dotted overrides, every shipped recipe."""

import argparse
import inspect
from pathlib import Path

import pytest

from vlpack.config import (
    RECIPES,
    Config,
    DataConfig,
    ModelConfig,
    TrainConfig,
    load_config,
    read_recipe,
    save_config,
)
from vlpack.model.presets import PRESETS

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


def test_a_duplicated_yaml_key_is_refused_with_its_lines(tmp_path: Path) -> None:
    """YAML keeps the last of two equal keys without a word; the config names file, line and key."""
    p = tmp_path / "twice.yaml"
    p.write_text("train:\n  max_steps: 3\n  seed: 1\n  max_steps: 5\n")
    with pytest.raises(ValueError) as e:
        load_config(p)
    assert str(e.value) == (
        f"{p}:4: the key 'max_steps' appears twice in one mapping (first at line 2; YAML would "
        "keep only the last value): delete one of them")
    p.write_text("data:\n  seq_len: 64\ndata:\n  seq_len: 128\n")
    with pytest.raises(ValueError, match=r"twice\.yaml:3: the key 'data' appears twice .*line 1;"):
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


# --- a recipe's base ---------------------------------------------------------------------------------
# A recipe's `base:`: the named recipe underneath, this file's keys on top, section by section.
def test_base_merges_section_by_section(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text(
        "model:\n  name: tiny-qwen3_vl\n  lora:\n    rank: 8\n    alpha: 16\n"
        "optim:\n  lr: 1.0e-4\n  betas: [0.9, 0.99]\ntrain:\n  max_steps: 7\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.yaml").write_text(
        "base: ../a.yaml\nmodel:\n  lora:\n    alpha: 32\noptim:\n  betas: [0.8, 0.9]\ntrain:\n")
    assert read_recipe(tmp_path / "sub" / "b.yaml") == {
        "model": {"name": "tiny-qwen3_vl", "lora": {"rank": 8, "alpha": 32}},
        "optim": {"lr": 1e-4, "betas": [0.8, 0.9]}, "train": {"max_steps": 7}}


def test_base_by_recipe_name_equals_the_recipe_with_overrides(tmp_path: Path) -> None:
    (tmp_path / "mine.yaml").write_text("base: tiny\noptim:\n  lr: 1.0e-5\n")
    assert load_config(tmp_path / "mine.yaml") == load_config("tiny", ["optim.lr=1e-5"])


def test_shipped_twins_are_their_base_plus_their_differences() -> None:
    assert load_config("tiny-nopack") == load_config(
        "tiny", ["data.packing=none", "data.batch_size=4", "train.output_dir=runs/tiny-nopack"])
    assert load_config("qwen3-vl-8b-lora") == load_config(
        "qwen3-vl-8b", ["model.lora.rank=16", "model.lora.alpha=32", "optim.lr=2e-4",
                        "train.output_dir=runs/qwen3-vl-8b-lora"])


def test_a_loop_of_bases_is_named(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text("base: b.yaml\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\n")
    with pytest.raises(ValueError, match=r"the base: recipes form a loop .*a\.yaml → .*b\.yaml → .*a\.yaml"):
        load_config(tmp_path / "a.yaml")


def test_a_missing_config_file_is_named_as_a_file(tmp_path: Path) -> None:
    """A path that reads as a file (a .yaml name, or a folder in it) and does not exist is said
    to be missing, not taken for an unknown recipe."""
    for given in (tmp_path / "nope.yaml", "configs/nope", tmp_path):
        with pytest.raises(ValueError, match=r"config file .* (does not exist|is a folder) "
                                             r"\(from .*\): give the path of a YAML file, or a "
                                             r"shipped recipe: .*tiny"):
            load_config(given)


def test_a_missing_base_is_named(tmp_path: Path) -> None:
    """A base: that is no recipe, or no file beside the recipe naming it nor from the working
    folder, is named with the file that names it and the places looked in."""
    (tmp_path / "a.yaml").write_text("base: nosuch\n")
    with pytest.raises(ValueError, match=r"a\.yaml: base: nosuch is neither a file beside it "
                                         r"\(.*nosuch\) nor found from .*: config nosuch is "
                                         r"neither a YAML file nor a recipe; recipes: "):
        load_config(tmp_path / "a.yaml")
    (tmp_path / "b.yaml").write_text("base: common.yaml\n")
    with pytest.raises(ValueError, match=r"b\.yaml: base: common\.yaml is neither a file beside "
                                         r"it \(.*common\.yaml\) nor found from .*: config "
                                         r"file common\.yaml does not exist"):
        load_config(tmp_path / "b.yaml")


# --- the presets the shipped recipes name ------------------------------------------------------------
@pytest.mark.parametrize("path", sorted(RECIPES.glob("*.yaml")), ids=lambda p: p.stem)
def test_recipes_name_known_presets(path: Path) -> None:
    assert load_config(path).model.name in PRESETS
