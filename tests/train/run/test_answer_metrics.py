"""Answer scores on literal cases worked out by hand (SQuAD normalisation, token F1 with repeated
tokens, JSON field accuracy with a missing field, a wrong field and an unparseable answer)."""

from __future__ import annotations

import pytest

from vlpack.train.run.answer_metrics import (
    exact_match,
    field_scores,
    leaves,
    normalize,
    score,
    token_f1,
)


def test_normalisation_drops_case_punctuation_articles_and_spaces() -> None:
    assert normalize("  The Cat,  sat on A mat! ") == "cat sat on mat"
    assert exact_match("The answer.", "answer") == 1.0
    assert exact_match("answers", "answer") == 0.0


def test_token_f1_by_hand() -> None:
    # "cat sat on mat" against "cat sat": 2 common of 4 and 2 -> P 1/2, R 1 -> F1 2/3
    assert token_f1("the cat sat on the mat", "a cat sat") == pytest.approx(2 / 3)
    # a repeated token counts min(3, 2) = 2 times: P 2/3, R 2/3 -> F1 2/3
    assert token_f1("cat cat cat", "cat cat dog") == pytest.approx(2 / 3)
    # "cat" once in the reference: 1 common of 3 and 2 -> P 1/3, R 1/2 -> F1 0.4
    assert token_f1("cat cat cat", "cat dog") == pytest.approx(0.4)
    assert token_f1("dog", "cat") == 0.0
    assert token_f1("the", "a") == 1.0  # both empty after normalisation
    assert token_f1("cat", "the") == 0.0


def test_json_leaves_are_dotted_paths() -> None:
    assert leaves({"a": 1, "b": [{"c": "x"}, 2]}) == {"a": 1, "b.0.c": "x", "b.1": 2}


REF = '{"shop": "A", "total": 10.5, "items": [{"name": "x", "qty": 2}]}'


def test_field_scores_missing_wrong_and_unparsed() -> None:
    # shop right, total wrong, items.0.name right, items.0.qty missing: 2 of 4
    assert field_scores('{"shop": "A", "total": 11, "items": [{"name": "x"}]}', REF) == (2, 4, True)
    assert field_scores("not json {", REF) == (0, 4, False)
    assert field_scores('```json\n{"shop": "A", "total": 10.50}\n```', REF) == (2, 4, True)
    assert field_scores('{"qty": true}', '{"qty": 1}') == (0, 1, True)  # true is not 1
    assert field_scores('{"qty": 2.0}', '{"qty": 2}') == (1, 1, True)
    assert field_scores("12", "12") is None  # a number is no JSON object


def test_score_of_a_small_set() -> None:
    pairs = [('{"shop": "A", "total": 11, "items": [{"name": "x"}]}', REF),
             ("not json {", REF),
             ("<think>\n\n</think>\n\nthe total is 10", "The total is 10.")]
    s = score(pairs)
    assert s == {"n": 3, "exact_match": pytest.approx(1 / 3), "token_f1": s["token_f1"],
                 "json_samples": 2, "fields": 8, "field_accuracy": 0.25, "unparsed": 1}
    # F1 of the first pair: normalised tokens by hand
    pred = normalize('{"shop": "A", "total": 11, "items": [{"name": "x"}]}').split()
    ref = normalize(REF).split()
    assert pred == ["shop", "total", "11", "items", "name", "x"]
    assert ref == ["shop", "total", "105", "items", "name", "x", "qty", "2"]
    f1_first = 2 * (5 / 6) * (5 / 8) / (5 / 6 + 5 / 8)
    assert s["token_f1"] == pytest.approx((f1_first + 0.0 + 1.0) / 3)
    assert "field_accuracy" not in score([("a", "b")])
