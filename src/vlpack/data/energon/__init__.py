"""Megatron-Energon data path: WebDataset shards read by Energon, packed by vlpack.

- `prepare.py`: JSONL conversations → tar shards (record JSON + image bytes per sample), then
  `energon prepare` (index, split, dataset.yaml for a crude dataset).
- `task_encoder.py`: the Qwen-VL `TaskEncoder`: cooker → `encode_sample` (vlpack's Encoder) →
  `select_samples_to_pack` (vlpack's planner) → `pack_selected_samples` (`build_thd_batch`) →
  `batch` (one packed row).
- `validate.py`: `validate_dataset_folder`, the check of a dataset folder's `.nv-meta` (no code
  hooks, no other class, no shard outside the folder) before Energon reads it.
- `loader.py`: `EnergonLoader`, the trainer-facing iterable of `ThdBatch` with exact resume and
  the same accounting as the JSONL `PackedLoader`.
"""

from __future__ import annotations

import importlib.util


def require_energon(what: str) -> None:
    """ValueError naming the install when Megatron-Energon (an optional extra) is missing."""
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec(
            "megatron.energon") is None:
        raise ValueError(f"{what} needs Megatron-Energon, which the core install leaves out: "
                         "pip install 'vlpack[energon]'")
