"""A checkpoint folder's own chat template, rendered by transformers, with vlpack's labels.

A folder fine-tuned or published with its own template (`chat_template.jinja`,
`chat_template.json`, or the `chat_template` of `tokenizer_config.json`) is rendered with that
template through the tokenizer's `apply_chat_template`, so training sees the prompts that
inference will. Supervision is found in the rendered text: every Qwen template is ChatML, so
each assistant turn is `<|im_start|>assistant\\n` … `<|im_end|>`; the labels cover what follows
the header up to and including `<|im_end|>` (a think block the template writes included), as on
the built-in path. A template that writes another number of assistant headers than the
conversation has assistant turns is refused with the folder named.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

ASSISTANT_HEADER = "<|im_start|>assistant\n"
END = "<|im_end|>"
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


@dataclass(frozen=True)
class FolderTemplate:
    """A chat template (Jinja source) and the file it came from."""

    source: str
    file: str


def find_template(folder: str | Path) -> FolderTemplate | None:
    """The chat template a HF checkpoint folder saved, in transformers' order of precedence
    (`chat_template.jinja`, `chat_template.json`, `tokenizer_config.json`), or None."""
    folder = Path(folder)
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return FolderTemplate(jinja.read_text(), str(jinja))
    for name in ("chat_template.json", "tokenizer_config.json"):
        path = folder / name
        if not path.is_file():
            continue
        try:
            template = json.loads(path.read_text()).get("chat_template")
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: cannot read it ({e}); fix the file, or set "
                             "data.chat_template=builtin to use vlpack's template") from None
        if isinstance(template, list):  # named templates: transformers uses "default"
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default")
        if isinstance(template, str) and template.strip():
            return FolderTemplate(template, str(path))
    return None


def load_template(value: str, folder: str | Path | None) -> FolderTemplate | None:
    """The template that `data.chat_template` names: "auto" (the model folder's when it has
    one), "builtin" (None: vlpack's own rendering) or a `.jinja` file."""
    if value == "builtin":
        return None
    if value == "auto":
        return find_template(folder) if folder is not None and Path(folder).is_dir() else None
    path = Path(value)
    if not path.is_file():
        raise ValueError(f"data.chat_template={value!r}: no such file; pass a .jinja file, "
                         "'auto' (the model folder's template) or 'builtin'")
    return FolderTemplate(path.read_text(), str(path))


def hf_messages(messages) -> list[dict]:
    """vlpack `Message`s as transformers' chat messages (text and image content items)."""
    out = []
    for m in messages:
        items = [{"type": "text", "text": c} if isinstance(c, str) else {"type": "image"}
                 for c in m.content]
        out.append({"role": m.role, "content": items})
    return out


def render(tokenizer, template: FolderTemplate, messages, key: str) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and its supervised character spans [(start, end), ...]."""
    text = tokenizer.apply_chat_template(hf_messages(messages), chat_template=template.source,
                                         tokenize=False, add_generation_prompt=False)
    spans = []
    for header in re.finditer(re.escape(ASSISTANT_HEADER), text):
        start = header.end()
        end = text.find(END, start)
        if end < 0:
            raise ValueError(f"{template.file}: the template leaves an assistant turn of sample "
                             f"{key} without {END}; vlpack supervises ChatML turns only "
                             "(data.chat_template=builtin uses vlpack's template)")
        spans.append((start, end + len(END)))
    want = sum(m.role == "assistant" for m in messages)
    if len(spans) != want:
        raise ValueError(f"{template.file}: the template writes {len(spans)} assistant turns "
                         f"for sample {key}, which has {want}; vlpack finds the supervised "
                         f"text by the {ASSISTANT_HEADER!r} header (data.chat_template=builtin "
                         "uses vlpack's template)")
    images = sum(1 for m in messages for c in m.content if not isinstance(c, str))
    if text.count("<|image_pad|>") != images:
        raise ValueError(f"{template.file}: the template writes {text.count('<|image_pad|>')} "
                         f"image placeholders for sample {key}, which has {images} images")
    return text, spans
