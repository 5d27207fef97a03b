"""Conversation → `EncodedSample`: the Qwen ChatML template, tokens, labels and pixels.

The rendering follows each family's released chat template (checked against the public
Qwen2-VL, Qwen3-VL and Qwen3.5 templates):

- every turn is `<|im_start|>{role}\\n{content}<|im_end|>\\n`; an image is
  `<|vision_start|>` + N × `<|image_pad|>` + `<|vision_end|>`, N = t·h·w / merge²; a video is
  the same with `<|video_pad|>` (qwen2 families); in qwen3 families its `<|vision_start|>` …
  `<|vision_end|>` holds one such span of h·w / merge² pads per temporal patch, each after its
  time as text (`<1.5 seconds>`), as transformers' processor expands the template's
  `<|video_pad|>` (data/video.py samples, sizes and times the frames).
- qwen2_vl / qwen2_5_vl insert the system turn "You are a helpful assistant." when the first
  message is not a system message; qwen3_vl / qwen3_5 insert none.
- qwen3_5 strips whitespace around each message's content, skips an empty system turn, and
  writes `<think>\\n{reasoning}\\n</think>\\n\\n` before every assistant answer after the last
  user query (a user message that only wraps a `<tool_response>` is none); the reasoning is
  the message's `reasoning_content`, else what the answer holds in `<think>…</think>`, else
  empty, and earlier answers lose theirs. We supervise that block: it is what the model emits
  after the bare `<|im_start|>assistant\\n` header, and keeping it makes training match the
  template (`supervise_empty_think=False` leaves an empty one out).

Tools, `tool` turns and assistant `tool_calls` are written as each family's template writes
them (`vlpack.data.tools`): a system turn with the tool schemas, the calls after the answer text,
a run of tool results as one user turn of `<tool_response>` blocks (Qwen3 families); Qwen2/2.5-VL
write neither tools nor calls, so a sample with them is refused (`tools_unsupported`).

Labels equal input_ids on the assistant content (think block and tool calls included) and its
`<|im_end|>`, IGNORE_INDEX elsewhere; an assistant turn with `"loss": false` has no labels, tool
results never have any, and `supervise_empty_think=False` leaves the empty think block out;
the `<|im_start|>assistant\\n` header and the `\\n` after `<|im_end|>` are not supervised.
Text between special tokens is tokenised as one piece, exactly as the tokenizer would split the
full rendered string, and special ids are spliced in directly. Given a checkpoint
folder's chat template (`vlpack.data.template`), that template renders the text instead and the
same label rule applies to the ChatML turns it writes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from vlpack.config import DataConfig, default_of
from vlpack.data import template as chat
from vlpack.data import tools
from vlpack.data import video as vid
from vlpack.data.media import image_size, open_image
from vlpack.data.processor import folder_processor, load_image_processor
from vlpack.data.tokenizer import has_tokenizer, load_tokenizer
from vlpack.data.types import (
    IGNORE_INDEX,
    TOKEN_TYPE_IMAGE,
    TOKEN_TYPE_TEXT,
    TOKEN_TYPE_VIDEO,
    BadSampleError,
    Conversation,
    EncodedSample,
    ImageRef,
    Message,
    SampleSize,
    VideoRef,
    located,
)
from vlpack.families import Family
from vlpack.families import family as family_of

_ATOMIC_TOKENS = ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                  "<|image_pad|>", "<|video_pad|>")
"""The special tokens the encoder splices in by id (never through the BPE)."""

GROUNDING_TOKENS = ("<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>", "<|box_end|>",
                    "<|quad_start|>", "<|quad_end|>")
"""Special tokens that Qwen-VL grounding data writes inside text by design (a referred object and
its box); allowed in data text. Every other special token of the tokenizer is refused there."""


@dataclass(slots=True)
class _Rendered:
    """A rendered conversation: text runs between atomic tokens, with supervised char spans."""

    items: list[tuple] = field(default_factory=list)
    """("text", str, [(start, end), ...]) | ("tok", id, supervised) | ("img", item index) |
    ("vid", item index, temporal patch or None for all)."""
    _buf: list[str] = field(default_factory=list)
    _len: int = 0
    _sup: list[tuple[int, int]] = field(default_factory=list)

    def text(self, s: str, supervised: bool = False) -> None:
        if s:
            if supervised:
                self._sup.append((self._len, self._len + len(s)))
            self._buf.append(s)
            self._len += len(s)

    def token(self, token_id: int, supervised: bool = False) -> None:
        self.flush()
        self.items.append(("tok", token_id, supervised))

    def image(self, index: int) -> None:
        self.flush()
        self.items.append(("img", index))

    def video(self, index: int, patch: int | None = None) -> None:
        self.flush()
        self.items.append(("vid", index, patch))

    def flush(self) -> None:
        if self._buf:
            self.items.append(("text", "".join(self._buf), self._sup))
            self._buf, self._len, self._sup = [], 0, []


def refuse_control_tokens(key: str, turn: int | None, m: Message, control: re.Pattern | None,
                          whose: str) -> None:
    """BadSampleError `special_token_in_text` when text of `m` (its reasoning and tool calls
    included; `turn` None: the tools) matches `control`, the special tokens of `whose` tokenizer
    (grounding markup aside): the tokenizer would read it as that token, so text could forge a
    turn boundary, an end of text or a media slot."""
    calls = [c.name + tools.tojson(c.arguments) for c in m.tool_calls]
    for c in (*m.content, m.reasoning or "", *calls):
        if control is not None and isinstance(c, str) and (hit := control.search(c)):
            where = "the tools" if turn is None else f"the {m.role} text of turn {turn}"
            raise BadSampleError(
                "special_token_in_text",
                f"{key}: {where} holds {hit.group()!r}, a special token of {whose}: it would "
                "become that token, not text (a forged turn boundary, end of text or media "
                "slot); remove it or break it up (e.g. '< |im_end| >'), and give images and "
                "videos as items",
            )


class Encoder:
    """Encodes conversations for one model family (see the module docstring for the template).

    `min_pixels`/`max_pixels` bound the resized image area (defaults: those of
    `processor_path`'s `preprocessor_config.json` when given, else the family's, see
    `vlpack.families`; the folder's normalisation too); `tokenizer_path` is a local HF
    checkpoint folder, else the built-in offline tokenizer is used. `max_image_pixels` raises
    Pillow's decompression-bomb limit on the source images; Pillow keeps that limit process-wide,
    so the encoder sets it before each open. `chat_template` (a checkpoint folder's, see
    `vlpack.data.template`) replaces the built-in rendering. `video` sets how videos are
    sampled and sized (`vlpack.data.video`; where it leaves a value None, that of
    `processor_path`'s `video_preprocessor_config.json`, else the family processor's);
    `tokens_per_second` is the model's, for Qwen2.5-VL's video positions.
    `supervise_empty_think=False` leaves the template's empty think block out of the labels.
    """

    def __init__(
        self,
        family: str = "qwen3_vl",
        tokenizer_path: str | None = None,
        min_pixels: int | None = None,
        max_pixels: int | None = None,
        max_image_pixels: int | None = None,
        processor_path: str | None = None,
        chat_template: chat.FolderTemplate | None = None,
        video: vid.VideoSettings | None = None,
        tokens_per_second: int | None = None,
        supervise_empty_think: bool = default_of(DataConfig, "supervise_empty_think"),
    ):
        self.family = family
        self.supervise_empty_think = supervise_empty_think
        """Whether the empty `<think>\n\n</think>\n\n` block a Qwen3.5 template writes before
        an answer without reasoning is trained (a block with reasoning always is)."""
        folder_video = vid.folder_settings(processor_path, family) if processor_path else None
        self.video_file = folder_video[1] if folder_video else None
        """The `video_preprocessor_config.json` whose settings this encoder uses, if any."""
        self.video = (video or vid.VideoSettings()).over(
            folder_video[0] if folder_video else vid.VideoSettings()).over(vid.DEFAULTS)
        """How videos are sampled and sized (data/video.py): `video`, else the folder's, else
        the family's."""
        self.tokens_per_second = tokens_per_second or family_of(family).tokens_per_second
        """Qwen2.5-VL's temporal positions per second of video (the model config's
        `vision_config.tokens_per_second`; the released checkpoints' by default)."""
        self.chat_template = chat_template
        self.max_image_pixels = max_image_pixels
        """Largest source image or video frame (width × height) opened; None: Pillow's
        decompression-bomb limit (about 179 M pixels)."""
        self.spec: Family = family_of(family)
        folder = folder_processor(processor_path, family) if processor_path else None
        self.processor_file = folder.file if folder else None
        """The `preprocessor_config.json` whose settings this encoder uses, if any."""
        self._norm = (folder.image_mean, folder.image_std) if folder else (None, None)
        if min_pixels is None:
            min_pixels = folder.min_pixels if folder and folder.min_pixels else self.spec.min_pixels
        if max_pixels is None:
            max_pixels = folder.max_pixels if folder and folder.max_pixels else self.spec.max_pixels
        self.min_pixels, self.max_pixels = int(min_pixels), int(max_pixels)
        if not 0 < self.min_pixels <= self.max_pixels:
            raise ValueError(
                f"need 0 < min_pixels <= max_pixels, got {self.min_pixels} and {self.max_pixels}"
            )
        self.tokenizer = load_tokenizer(family, tokenizer_path)
        if chat_template is not None:
            chat.probe(self.tokenizer, chat_template)  # a template unfit for every sample fails here
        self._tk = self.tokenizer.backend_tokenizer
        control = sorted(t.content for t in self.tokenizer.added_tokens_decoder.values()
                         if t.special and t.content not in GROUNDING_TOKENS)
        self._control = re.compile("|".join(map(re.escape, control))) if control else None
        """The tokenizer's special tokens other than grounding markup: refused in data text."""
        self._ids = {t: self._special_id(t) for t in _ATOMIC_TOKENS}
        self.image_pad_id = self._ids["<|image_pad|>"]
        self.video_pad_id = self._ids["<|video_pad|>"]
        self.vision_start_id = self._ids["<|vision_start|>"]
        self.vision_end_id = self._ids["<|vision_end|>"]

    @classmethod
    def from_config(cls, d: DataConfig, family: str, folder: str | Path | None, *,
                    tokens_per_second: int | None = None,
                    folder_processor: bool = True) -> Encoder:
        """The encoder of the `data` section `d` for `family`: the one way vlpack builds one.
        `folder` (a checkpoint folder, or None) gives the tokenizer when `data.tokenizer` names
        none and it holds one, the chat template of `data.chat_template=auto`, and, with
        `folder_processor`, its image and video processor settings; `tokens_per_second` is
        the model's (None: the family's)."""
        tokenizer = d.tokenizer
        if tokenizer is None and folder is not None and has_tokenizer(folder):
            tokenizer = str(folder)
        is_dir = folder is not None and Path(folder).is_dir()
        return cls(family, tokenizer_path=tokenizer, min_pixels=d.min_pixels,
                   max_pixels=d.max_pixels, max_image_pixels=d.max_image_pixels, video=d.video,
                   tokens_per_second=tokens_per_second,
                   processor_path=str(folder) if is_dir and folder_processor else None,
                   chat_template=chat.load_template(d.chat_template, folder),
                   supervise_empty_think=d.supervise_empty_think)

    def length_settings(self) -> dict[str, object]:
        """Every attribute of this encoder as a JSON value (tokenizers by their content's hash):
        what the size cache keys on (`vlpack.data.size_cache`). All attributes are taken, not a
        chosen few, so a new setting that changes lengths cannot be left out of the key."""
        from vlpack.data.size_cache import setting_value

        return {k: setting_value(k, v) for k, v in sorted(vars(self).items())}

    def _special_id(self, token: str) -> int:
        tid = self.tokenizer.convert_tokens_to_ids(token)
        if tid is None or tid == self.tokenizer.unk_token_id:
            raise ValueError(f"the {self.family} tokenizer has no {token}: is it a Qwen-VL one?")
        return int(tid)

    @property
    def image_processor(self):
        """transformers' Qwen2-VL PIL image processor for this family and pixel range."""
        return load_image_processor(self.family, self.min_pixels, self.max_pixels, *self._norm)

    # ---------------------------------------------------------------- public API

    def encode(self, conv: Conversation, max_tokens: int | None = None) -> EncodedSample:
        """Tokens, labels, token types, pixel values and grids of `conv`; with `max_tokens`,
        `truncate(encode(conv), max_tokens)`, decoding only the visual items the cut keeps."""
        if max_tokens is not None:
            skeleton = self.skeleton(conv)
            if len(skeleton) > max_tokens:
                kept = len(self.truncate(skeleton, max_tokens).image_grid_thw)  # refusals first
                return self.truncate(self._encode(conv, kept), max_tokens)
        return self._encode(conv, None)

    def _encode(self, conv: Conversation, decode: int | None) -> EncodedSample:
        """`encode(conv)` with the pixels of the first `decode` visual items only (None: all);
        the later items' grids come from their headers, as when measuring. Images are decoded
        and resized one at a time, so a sample holds one full-size image at once."""
        n = len(conv.visuals) if decode is None else decode
        decoded = sum(isinstance(r, ImageRef) for r in conv.visuals[:n])
        sizes, parts = [], []
        for j, ref in enumerate(conv.images):
            if j >= decoded:
                sizes.append(image_size(conv.key, ref, self.max_image_pixels))
                continue
            image = open_image(conv.key, ref, self.max_image_pixels)
            grid = self._grid(conv.key, ref, *image.size)  # refuse what the processor would
            if image.size != image_size(conv.key, ref, self.max_image_pixels):
                raise BadSampleError(  # planning used the header's size: the two must agree
                    "corrupt_image", f"{conv.key}: image {ref.path}: its EXIF orientation is "
                    "stored after the pixel data, so its upright size is unknown until it is "
                    "decoded: re-save the image (upright, or with its metadata first)")
            sizes.append(image.size)
            out = self.image_processor(images=[image], return_tensors=None)
            assert tuple(np.asarray(out["image_grid_thw"]).reshape(-1).tolist()) == grid, conv.key
            parts.append(np.ascontiguousarray(out["pixel_values"], dtype=np.float32))
            del image, out
        items = self._items(conv, sizes)
        images_left = iter(parts)
        mean, std = self._video_norm()
        stream = [next(images_left) if it.plan is None else vid.patches(
            vid.decode(conv.key, it.ref, it.plan.indices, (it.plan.height, it.plan.width)),
            it.plan, self.family, mean, std) for it in items[:n]]
        sample = self._assemble(conv, items)
        sample.pixel_values = np.concatenate(stream) if stream else None
        return sample

    def measure(self, conv: Conversation) -> SampleSize:
        """Exact `SampleSize` of `encode(conv)`, from image headers and video metadata only
        (no pixel decode)."""
        return self.skeleton(conv).size

    def skeleton(self, conv: Conversation) -> EncodedSample:
        """`encode(conv)` without pixels: grids come from the image headers and the videos'
        metadata."""
        sizes = [image_size(conv.key, r, self.max_image_pixels) for r in conv.images]
        return self._assemble(conv, self._items(conv, sizes))

    def _items(self, conv: Conversation, image_sizes: list[tuple[int, int]]) -> list[_Item]:
        """Grid and plan of each visual item of `conv`, in order (images from their sizes)."""
        sizes = iter(image_sizes)
        items = []
        for ref in conv.visuals:
            if isinstance(ref, ImageRef):
                items.append(_Item(ref, self._grid(conv.key, ref, *next(sizes))))
            else:
                plan = vid.plan(self.family, conv.key, ref, self.video, self.max_image_pixels)
                items.append(_Item(ref, plan.grid, plan))
        return items

    def _video_norm(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """Mean and std the video pixels are normalised with (as the images')."""
        proc = self.image_processor
        return tuple(proc.image_mean), tuple(proc.image_std)

    def grid(self, width: int, height: int) -> tuple[int, int, int]:
        """(t, h, w) patch grid of a `width`×`height` image after the processor's resize
        (transformers' own `smart_resize`); ValueError past an aspect ratio of 200."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        h, w = smart_resize(height, width, factor=self.spec.factor,
                            min_pixels=self.min_pixels, max_pixels=self.max_pixels)  # fmt: skip
        return 1, h // self.spec.patch_size, w // self.spec.patch_size

    def _grid(self, key: str, ref: ImageRef, width: int, height: int) -> tuple[int, int, int]:
        try:
            return self.grid(width, height)
        except ValueError as e:
            raise BadSampleError(
                "bad_image_size", f"{key}: image {ref.path} ({width}x{height}): {e}; crop or pad it"
            ) from None

    def truncate(self, sample: EncodedSample, max_tokens: int) -> EncodedSample:
        """Cut `sample` to at most `max_tokens` tokens, never through an image or video: a cut
        inside one moves before its (first) `<|vision_start|>`, and that item and later ones lose
        their grid and pixel rows. Raises BadSampleError when no supervised token remains."""
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be positive, got {max_tokens}")
        if len(sample) <= max_tokens:
            return sample
        cut, kept = self._safe_cut(sample, max_tokens)
        if not (sample.labels[:cut] != IGNORE_INDEX).any():
            dropped = len(sample.image_grid_thw) - kept
            video = dropped and sample.visual_kinds[kept] == TOKEN_TYPE_VIDEO
            reason = "overlong_video" if video else "overlong_image" if dropped else \
                "overlong_prompt"
            raise BadSampleError(
                reason,
                f"{sample.key}: {len(sample)} tokens, and cutting to {max_tokens}"
                + (f" (before visual item {kept}, which cannot be split)" if dropped else "")
                + " leaves no answer token: raise the sequence length, lower max_pixels, "
                "or drop the sample",
            )
        return EncodedSample(
            key=sample.key,
            input_ids=sample.input_ids[:cut],
            labels=sample.labels[:cut],
            mm_token_type_ids=sample.mm_token_type_ids[:cut],
            **sample.keep_visuals(kept),
        )

    def truncated_size(self, item: Conversation | EncodedSample, max_tokens: int) -> SampleSize:
        """`truncate(...).size` without decoding pixels (a conversation is measured first); a
        conversation's BadSampleError names its `file:line`."""
        if isinstance(item, EncodedSample):
            return self.truncate(item, max_tokens).size
        try:
            return self.truncate(self.skeleton(item), max_tokens).size
        except BadSampleError as e:
            raise located(e, item) from None

    # ---------------------------------------------------------------- internals

    def _safe_cut(self, sample: EncodedSample, max_tokens: int) -> tuple[int, int]:
        """Largest cut ≤ max_tokens outside visual spans, and the number of items kept."""
        cut, kept = max_tokens, 0
        wrapped = self.spec.video_style == "qwen3"  # an outer start/end around a video
        for i, (first, last) in enumerate(_item_spans(sample, self.spec.merge_size)):
            video = sample.visual_kinds[i] == TOKEN_TYPE_VIDEO
            start, end = first - 1, last + 1  # its <|vision_start|> and <|vision_end|>
            if video and wrapped:  # the outer pair, before the first time text and after
                start = int(np.flatnonzero(sample.input_ids[:start] == self.vision_start_id)[-1])
                end += 1
            if end <= cut:
                kept = i + 1
            else:
                cut = min(cut, max(start, 0))
                break
        return cut, kept

    def _render(self, conv: Conversation, items: list[_Item]) -> _Rendered:
        for i, m in enumerate(conv.messages):
            if m.role not in ("user", "tool") and any(not isinstance(c, str) for c in m.content):
                raise BadSampleError(
                    "bad_schema", f"{conv.key}: images and videos are only supported in user and "
                    "tool turns")
            self._refuse_control_tokens(conv.key, i, m)
        self._refuse_control_tokens(conv.key, None, Message("tools", (tools.tojson(conv.tools),)))
        if self.chat_template is not None:
            return self._render_template(conv, items)
        fmt = self.spec.tool_format
        if fmt is None and (conv.tools or any(m.tool_calls for m in conv.messages)):
            raise BadSampleError(
                "tools_unsupported",
                f"{conv.key}: the {self.family} chat template writes neither tools nor tool calls, "
                "so this sample's would vanish from training: write them into the text (the "
                "system prompt and the answers), or train with a chat template that writes them "
                "(data.chat_template=FILE.jinja)")
        return self._render_builtin(conv, items, fmt)

    def _render_builtin(self, conv: Conversation, items: list[_Item], fmt: str | None
                        ) -> _Rendered:
        """`conv` as the family's released template renders it (module docstring)."""
        spec, ids = self.spec, self._ids
        r = _Rendered()
        msgs = conv.messages
        if conv.tools:
            system = msgs[0] if msgs and msgs[0].role == "system" else None
            text = None if system is None else "".join(
                _trim(system.content) if spec.trim_content else system.content)  # type: ignore[arg-type]
            r.token(ids["<|im_start|>"])
            r.text("system\n" + tools.system_text(fmt, conv.tools, text))
            r.token(ids["<|im_end|>"])
            r.text("\n")
            msgs = msgs[1:] if system is not None else msgs
        elif spec.default_system and (not msgs or msgs[0].role != "system"):
            msgs = (Message("system", (spec.default_system,)), *msgs)
        last_query = _last_query(msgs)
        n_item = 0
        for i, m in enumerate(msgs):
            content = _trim(m.content) if spec.trim_content else m.content
            if m.role == "system" and spec.trim_content and not content:
                continue  # qwen3_5 skips an empty system turn
            if m.role == "tool" and fmt is not None:
                n_item = self._tool_result(r, msgs, i, content, items, n_item)
                continue
            answer = m.role == "assistant"
            sup = answer and m.loss
            r.token(ids["<|im_start|>"])
            r.text(m.role + "\n")
            if answer and spec.think_prefix:
                reasoning, text = _split_reasoning("".join(content)) if m.reasoning is None \
                    else (m.reasoning.strip(), "".join(content))  # type: ignore[arg-type]
                if i > last_query:
                    r.text(f"<think>\n{reasoning}\n</think>\n\n",
                           supervised=sup and (bool(reasoning) or self.supervise_empty_think))
                content = (text,)
            n_item = self._content(r, content, sup, items, n_item)
            if m.tool_calls:
                r.text(tools.calls_text(fmt, m.tool_calls, "".join(content)),  # type: ignore[arg-type]
                       supervised=sup)
            r.token(ids["<|im_end|>"], supervised=sup)
            r.text("\n")
        r.flush()
        assert n_item == len(items), (conv.key, n_item, len(items))
        return r

    def _content(self, r: _Rendered, content: tuple, supervised: bool, items: list[_Item],
                 n_item: int) -> int:
        """Write a message's text, images and videos; the index of the next visual item."""
        ids = self._ids
        for c in content:
            if isinstance(c, str):
                r.text(c, supervised=supervised)
                continue
            r.token(ids["<|vision_start|>"])
            if isinstance(c, ImageRef):
                r.image(n_item)
            else:
                self._video_spans(r, n_item, items[n_item])
            r.token(ids["<|vision_end|>"])
            n_item += 1
        return n_item

    def _tool_result(self, r: _Rendered, msgs: tuple[Message, ...], i: int, content: tuple,
                     items: list[_Item], n_item: int) -> int:
        """A tool result in `<tool_response>`, a run of them in one user turn (data/tools.py)."""
        if i == 0 or msgs[i - 1].role != "tool":
            r.token(self._ids["<|im_start|>"])
            r.text("user")
        r.text("\n<tool_response>\n")
        n_item = self._content(r, content, False, items, n_item)
        r.text("\n</tool_response>")
        if i + 1 == len(msgs) or msgs[i + 1].role != "tool":
            r.token(self._ids["<|im_end|>"])
            r.text("\n")
        return n_item

    def _refuse_control_tokens(self, key: str, turn: int | None, m: Message) -> None:
        """BadSampleError when text of `m` holds a special token of the tokenizer
        (`refuse_control_tokens`)."""
        refuse_control_tokens(key, turn, m, self._control, f"the {self.family} tokenizer")

    def _video_spans(self, r: _Rendered, index: int, item: _Item) -> None:
        """A video's pads: one span (qwen2 families), or a timed span per temporal patch
        (qwen3 families: transformers' processor expands the template's `<|video_pad|>`
        between its `<|vision_start|>` and `<|vision_end|>`, which stay)."""
        if self.spec.video_style != "qwen3":
            r.video(index)
            return
        start, end = self._ids["<|vision_start|>"], self._ids["<|vision_end|>"]
        for k, seconds in enumerate(item.plan.timestamps):
            r.text(f"<{seconds:.1f} seconds>")
            r.token(start)
            r.video(index, k)
            r.token(end)

    def _render_template(self, conv: Conversation, items: list[_Item]) -> _Rendered:
        """`conv` rendered by the folder's chat template: its text between the atomic tokens,
        split where supervision starts and ends. A video's `<|video_pad|>` becomes its spans
        (`_video_spans`), as the family's processor expands it."""
        text, spans = chat.render(self.tokenizer, self.chat_template, conv.messages, conv.key,
                                  tools=conv.tools,
                                  supervise_empty_think=self.supervise_empty_think)

        def inside(pos: int) -> bool:
            return any(a <= pos < b for a, b in spans)

        cuts = sorted({a for a, _ in spans} | {b for _, b in spans})
        r = _Rendered()
        n_item, pos = 0, 0
        for piece in _ATOMIC.split(text):
            end = pos + len(piece)
            if piece == "<|image_pad|>":
                r.image(n_item)
                n_item += 1
            elif piece == "<|video_pad|>":
                self._video_spans(r, n_item, items[n_item])
                n_item += 1
            elif piece in self._ids:
                r.token(self._ids[piece], supervised=inside(pos))
            else:
                at = pos
                for cut in [c for c in cuts if pos < c < end] + [end]:
                    r.text(text[at:cut], supervised=inside(at))
                    at = cut
            pos = end
        r.flush()
        assert n_item == len(items), (conv.key, n_item, len(items))
        return r

    def _assemble(self, conv: Conversation, items: list[_Item]) -> EncodedSample:
        rendered = self._render(conv, items)
        texts = [it[1] for it in rendered.items if it[0] == "text"]
        encodings = iter(self._tk.encode_batch(texts, add_special_tokens=False) if texts else [])
        merge2 = self.spec.merge_size**2
        ids_parts, sup_parts, type_parts = [], [], []
        for item in rendered.items:
            if item[0] == "text":
                enc = next(encodings)
                ids = np.asarray(enc.ids, dtype=np.int64)
                sup = np.zeros(len(ids), dtype=bool)
                if item[2]:
                    off = np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2)
                    for a, b in item[2]:
                        sup |= (off[:, 1] > a) & (off[:, 0] < b)
                ids_parts.append(ids)
                sup_parts.append(sup)
                type_parts.append(np.full(len(ids), TOKEN_TYPE_TEXT, dtype=np.int8))
            elif item[0] == "tok":
                ids_parts.append(np.array([item[1]], dtype=np.int64))
                sup_parts.append(np.array([item[2]]))
                type_parts.append(np.full(1, TOKEN_TYPE_TEXT, dtype=np.int8))
            else:
                t, h, w = items[item[1]].grid
                is_video = item[0] == "vid"
                n = (t if not is_video or item[2] is None else 1) * h * w // merge2
                pad = self.video_pad_id if is_video else self.image_pad_id
                ids_parts.append(np.full(n, pad, dtype=np.int64))
                sup_parts.append(np.zeros(n, dtype=bool))
                type_parts.append(np.full(n, TOKEN_TYPE_VIDEO if is_video else TOKEN_TYPE_IMAGE,
                                          dtype=np.int8))
        input_ids = np.concatenate(ids_parts)
        supervised = np.concatenate(sup_parts)
        tps = self.tokens_per_second
        spg = np.array([0.0 if it.plan is None else it.plan.second_per_grid for it in items],
                       dtype=np.float32)
        step = np.array([tps * s if tps and it.plan is not None else 1.0
                         for it, s in zip(items, spg, strict=True)], dtype=np.float32)
        return EncodedSample(
            key=conv.key,
            input_ids=input_ids,
            labels=np.where(supervised, input_ids, IGNORE_INDEX),
            mm_token_type_ids=np.concatenate(type_parts),
            image_grid_thw=np.array([it.grid for it in items], np.int64).reshape(-1, 3),
            visual_kinds=np.array([TOKEN_TYPE_IMAGE if it.plan is None else TOKEN_TYPE_VIDEO
                                   for it in items], dtype=np.int8),
            second_per_grid=spg,
            temporal_step=step,
        )


@dataclass(frozen=True, slots=True)
class _Item:
    """One visual item of a conversation: its grid, and for a video how it is encoded."""

    ref: ImageRef | VideoRef
    grid: tuple[int, int, int]
    plan: vid.VideoPlan | None = None


def _item_spans(sample: EncodedSample, merge_size: int) -> list[tuple[int, int]]:
    """[first, last) token range of each visual item's pads (a qwen3-family video's first
    span to its last), in order."""
    types = sample.mm_token_type_ids
    is_pad = types != TOKEN_TYPE_TEXT
    starts = np.flatnonzero(is_pad & np.concatenate(([True], ~is_pad[:-1])))
    ends = np.flatnonzero(is_pad & np.concatenate((~is_pad[1:], [True]))) + 1
    out, run = [], 0
    for t, h, w in sample.image_grid_thw.tolist():
        frame = h * w // merge_size**2
        n_runs = t if t > 1 and ends[run] - starts[run] == frame else 1
        out.append((int(starts[run]), int(ends[run + n_runs - 1])))
        run += n_runs
    assert run == len(starts), (sample.key, run, len(starts))
    return out


_ATOMIC = re.compile("(" + "|".join(re.escape(t) for t in _ATOMIC_TOKENS) + ")")


def _trim(content: tuple[str | ImageRef, ...]) -> tuple[str | ImageRef, ...]:
    """Jinja's `|trim` on the rendered content: strip whitespace at both ends, through text
    items only (an image renders as special tokens, which are not whitespace)."""
    items = list(content)
    while items and isinstance(items[0], str) and not items[0].strip():
        items.pop(0)
    while items and isinstance(items[-1], str) and not items[-1].strip():
        items.pop()
    if items and isinstance(items[0], str):
        items[0] = items[0].lstrip()
    if items and isinstance(items[-1], str):
        items[-1] = items[-1].rstrip()
    return tuple(items)


def _last_query(msgs: tuple[Message, ...]) -> int:
    """Index of the last user message that asks something (-1 if none): as the Qwen3.5 template
    counts, a user message that only wraps a tool result in `<tool_response>` does not."""
    for i in range(len(msgs) - 1, -1, -1):
        text = "".join(c if isinstance(c, str) else "\0" for c in _trim(msgs[i].content))
        if msgs[i].role == "user" and not (text.startswith("<tool_response>")
                                           and text.endswith("</tool_response>")):
            return i
    return -1


def _split_reasoning(content: str) -> tuple[str, str]:
    """(reasoning, answer) as the qwen3_5 template splits an answer holding `</think>`."""
    if "</think>" not in content:
        return "", content
    reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
    return reasoning.strip(), content.split("</think>")[-1].lstrip("\n")
