"""Scores of generated answers against references: exact match, token F1, JSON field accuracy.

Exact match and token F1 compare SQuAD-normalised text (lowercased, punctuation and the
articles a/an/the removed, whitespace collapsed); F1 counts a repeated token as often as both
sides hold it. A reference that parses as a JSON object or array (the synthetic receipts'
answers, data/synth.py) is also scored field by field: each leaf (`items.0.price`) is right when
the parsed prediction holds an equal value at the same path; a prediction that does not parse
scores 0 on every field and counts as `unparsed`. A `<think>…</think>` block before an answer is
not scored.
"""

from __future__ import annotations

import json
import re
import string
from collections import Counter
from collections.abc import Iterable
from typing import Any

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_THINK = re.compile(r"^\s*<think>.*?</think>\s*", re.DOTALL)
_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)


def answer_text(text: str) -> str:
    """`text` without a leading `<think>…</think>` block and surrounding whitespace."""
    return _THINK.sub("", text).strip()


def normalize(text: str) -> str:
    """SQuAD's normalisation: lowercase, no punctuation, no articles, single spaces."""
    text = "".join(c for c in text.lower() if c not in set(string.punctuation))
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, reference: str) -> float:
    """1.0 when the normalised strings are equal, else 0.0."""
    return float(normalize(prediction) == normalize(reference))


def token_f1(prediction: str, reference: str) -> float:
    """F1 of the normalised tokens, each counted min(times in prediction, times in reference)
    times; 1.0 when both are empty, 0.0 when one is."""
    pred, ref = normalize(prediction).split(), normalize(reference).split()
    if not pred or not ref:
        return float(pred == ref)
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def parse_json(text: str) -> dict | list | None:
    """The JSON object or array `text` holds (inside a ``` fence or not), else None."""
    text = text.strip()
    if (m := _FENCE.match(text)) is not None:
        text = m.group(1)
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict | list) else None


def leaves(value: Any, prefix: str = "") -> dict[str, Any]:
    """Every leaf of a parsed JSON value by its dotted path (list items by index)."""
    if isinstance(value, dict):
        items: Iterable[tuple[Any, Any]] = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return {prefix: value}
    out: dict[str, Any] = {}
    for k, v in items:
        out.update(leaves(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def field_scores(prediction: str, reference: str) -> tuple[int, int, bool] | None:
    """(right fields, reference fields, prediction parsed) when `reference` is JSON, else None."""
    ref = parse_json(reference)
    if ref is None:
        return None
    want = leaves(ref)
    pred = parse_json(prediction)
    if pred is None:
        return 0, len(want), False
    got = leaves(pred)
    right = sum(k in got and _same(got[k], v) for k, v in want.items())
    return right, len(want), True


def _same(a: Any, b: Any) -> bool:
    """Equal JSON leaves (3 and 3.0 are; true and 1 are not)."""
    return a == b and isinstance(a, bool) == isinstance(b, bool)


def score(pairs: Iterable[tuple[str, str]]) -> dict[str, Any]:
    """Metrics of (prediction, reference) pairs: `n`, mean `exact_match` and `token_f1`, and
    over the JSON references `json_samples`, `fields`, `field_accuracy` (right fields / fields)
    and `unparsed` (predictions that are not JSON)."""
    n, em, f1, json_n, fields, right, unparsed = 0, 0.0, 0.0, 0, 0, 0, 0
    for prediction, reference in pairs:
        prediction, reference = answer_text(prediction), answer_text(reference)
        n += 1
        em += exact_match(prediction, reference)
        f1 += token_f1(prediction, reference)
        if (s := field_scores(prediction, reference)) is not None:
            json_n, right, fields, unparsed = json_n + 1, right + s[0], fields + s[1], \
                unparsed + (not s[2])
    out: dict[str, Any] = {"n": n, "exact_match": em / n if n else None,
                           "token_f1": f1 / n if n else None}
    if json_n:
        out.update(json_samples=json_n, fields=fields,
                   field_accuracy=right / fields if fields else None, unparsed=unparsed)
    return out
