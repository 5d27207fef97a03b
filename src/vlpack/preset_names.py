"""The names of the model presets and the published checkpoints behind them: the config's
check of a preset on user data reads them here, below the presets themselves
(`vlpack.model.presets`, which registers exactly these names)."""

from __future__ import annotations

import re

from vlpack.families import FAMILIES

PUBLISHED = {
    "qwen3-vl-2b": "Qwen/Qwen3-VL-2B-Instruct",
    "qwen3-vl-8b": "Qwen/Qwen3-VL-8B-Instruct",
    "qwen3-vl-30b-a3b": "Qwen/Qwen3-VL-30B-A3B-Instruct",
    "qwen3.5-9b": "Qwen/Qwen3.5-9B",
    "qwen3.5-35b-a3b": "Qwen/Qwen3.5-35B-A3B",
}
"""The published checkpoint (a Hugging Face hub repository) whose shapes a real-size preset has."""
TEST_MODELS = tuple(f"tiny-{f}" for f in FAMILIES)
"""The tiny test presets, one per family: no published weights."""
NAMES = (*TEST_MODELS, *PUBLISHED)
"""Every preset name (`BASE-<n>L` cuts of them aside)."""


def random_weights_refusal(name: str, source: str) -> str:
    """Why `model.name=name` (a preset, not a folder) is refused on user data
    (`data.source=source`) without `model.init=random`, and the fix: the folder to download."""
    base = re.sub(r"-\d+L$", "", name)
    repo = PUBLISHED.get(base)
    head = (f"model.name={name} is a preset: random weights, never loaded from anywhere, and "
            f"data.source={source} is your data, so this run would fine-tune an untrained model")
    if repo is None:
        what = "a test model with no published weights" if base in NAMES else "not a folder"
        return (f"{head} ({name} is {what}). Pass a local checkpoint folder (config.json + "
                "*.safetensors) as model.name=FOLDER, or set model.init=random to train random "
                "weights on purpose")
    folder = repo.split("/")[1]
    return (f"{head}. Download its published weights once (`hf download {repo} --local-dir "
            f"{folder}`, or `huggingface-cli download` with older huggingface_hub) and train "
            f"with model.name={folder} (its weights, tokenizer, chat template and image settings), "
            "or set model.init=random to train random weights on purpose")
