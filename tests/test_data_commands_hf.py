"""`vlpack pack` and `vlpack data validate` read a Hugging Face dataset as they read JSONL: the
same good samples as the dataset's JSONL twin, and the bad row named by its row."""

from __future__ import annotations

import json

import pytest

from vlpack.cli import main

pytest.importorskip("datasets")
from tests.test_hf_source import data  # noqa: F401  (the fixture: a dataset and its twin)


def test_pack_reads_a_dataset_as_its_jsonl_twin(data, capsys) -> None:  # noqa: F811
    ds, jsonl = data
    reports = []
    for path in (ds, jsonl):
        assert main(["pack", str(path), "--seq-len", "2048", "--json"]) == 0
        reports.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    hf, twin = reports
    assert hf["samples"] == 5 and twin["samples"] == 4  # the twin holds the 4 good rows
    assert hf["packed"] == twin["packed"] == 4
    assert sum(hf["skipped"].values()) == 1 and "ds[3]" in hf["problems"][0]["message"]
    for k in ("bins", "efficiency", "vision_tokens_per_bin"):
        assert hf[k] == twin[k], k


def test_validate_reads_a_dataset(data, capsys) -> None:  # noqa: F811
    ds, _ = data
    assert main(["data", "validate", str(ds), "--workers", "1", "--json"]) == 1
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (r["samples"], r["good"]) == (5, 4)
    assert len(r["problems"]) == 1 and "ds[3]" in r["problems"][0]["message"]
