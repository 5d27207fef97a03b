"""A checkpoint folder's own chat template, rendered by transformers, with vlpack's labels.

A folder fine-tuned or published with its own template (`chat_template.jinja`,
`chat_template.json`, or the `chat_template` of `tokenizer_config.json`) is rendered with that
template through the tokenizer's `apply_chat_template`, so training sees the prompts that
inference will. Supervision is found in the rendered text: every Qwen template is ChatML, so
each assistant turn is `<|im_start|>assistant\\n` … `<|im_end|>`; the labels cover what follows
the header up to and including `<|im_end|>` (a think block the template writes included, its
tool calls too), as on the built-in path; a turn with `"loss": false` is left out, and so is an
empty `<think>\n\n</think>\n\n` block at the start of a turn with `supervise_empty_think=False`.
Tools and tool calls go to the template as transformers takes them (`tools=`, and `tool_calls`
of `{"type": "function", "function": {"name", "arguments"}}` on assistant messages).

A template is tried on a fixed conversation when it is loaded: one that does not write ChatML
turns, drops the answers' text or the images is refused there, with its file named. Per
sample, a conversation the template cannot render (its own `raise_exception`), message text
holding `<|im_start|>` / `<|im_end|>` (which would make the turns ambiguous), or a rendering
whose assistant turns, answers, tool calls, tools or image placeholders do not match the sample
is a bad sample (`template_mismatch`): skipped and counted in training, listed by `vlpack data validate`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from vlpack.data.types import BadSampleError, ImageRef, Message, VideoRef

ASSISTANT_HEADER = "<|im_start|>assistant\n"
END = "<|im_end|>"
EMPTY_THINK = "<think>\n\n</think>\n\n"


@dataclass(frozen=True)
class FolderTemplate:
    """A chat template (Jinja source) and the file it came from."""

    source: str
    file: str


def find_template(folder: str | Path) -> FolderTemplate | None:
    """The chat template a HF checkpoint folder saved, or None: `chat_template.json` or
    `chat_template.jinja` (the processor's files; a folder with both that differ is refused),
    else the `chat_template` of `tokenizer_config.json`."""
    folder = Path(folder)
    found = []
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        found.append(FolderTemplate(jinja.read_text(), str(jinja)))
    for name in ("chat_template.json", "tokenizer_config.json"):
        path = folder / name
        if not path.is_file() or (found and name == "tokenizer_config.json"):
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
            found.append(FolderTemplate(template, str(path)))
    if len(found) == 2 and found[0].file.endswith(".jinja") and found[1].file.endswith(
            "chat_template.json") and found[0].source != found[1].source:
        raise ValueError(f"{folder} holds two different chat templates, chat_template.jinja and "
                         "chat_template.json: delete the one inference does not use, or name one "
                         "with data.chat_template=FILE")
    return found[0] if found else None


def load_template(value: str, folder: str | Path | None) -> FolderTemplate | None:
    """The template that `data.chat_template` names: "auto" (the model folder's when it has
    one), "builtin" (None: vlpack's own rendering) or a `.jinja` file."""
    if value == "builtin":
        return None
    if value == "auto":
        found = find_template(folder) if folder is not None and Path(folder).is_dir() else None
    else:
        path = Path(value)
        if not path.is_file():
            raise ValueError(f"data.chat_template={value!r}: no such file; pass a .jinja file, "
                             "'auto' (the model folder's template) or 'builtin'")
        found = FolderTemplate(path.read_text(), str(path))
    return found


def probe(tokenizer, template: FolderTemplate) -> None:
    """ValueError naming the template's file when it does not render a two-turn conversation
    with an image and a text-only follow-up as ChatML with both answers and the image."""
    msgs = (Message("user", (ImageRef("probe.png"), "What is the total?")),
            Message("assistant", ("12.50",)), Message("user", ("And the date?",)),
            Message("assistant", ("2026-12-01",)))
    try:
        render(tokenizer, template, msgs, "the probe conversation", supervise_empty_think=True)
    except BadSampleError as e:
        raise ValueError(f"{e}; data.chat_template=builtin uses vlpack's template") from None


def hf_messages(messages) -> list[dict]:
    """vlpack `Message`s as transformers' chat messages: plain string content for text-only
    messages (templates written for text models read only strings), else text and image
    items."""
    out = []
    for m in messages:
        if all(isinstance(c, str) for c in m.content):
            out.append({"role": m.role, "content": "".join(m.content)})
        else:
            out.append({"role": m.role, "content": [
                {"type": "text", "text": c} if isinstance(c, str) else
                {"type": "video"} if isinstance(c, VideoRef) else {"type": "image"}
                for c in m.content]})
        if m.reasoning is not None:
            out[-1]["reasoning_content"] = m.reasoning
        if m.tool_calls:
            out[-1]["tool_calls"] = [{"type": "function", "function": {
                "name": c.name, "arguments": c.arguments}} for c in m.tool_calls]
    return out


def _answer(message: Message) -> str:
    """The answer text an assistant turn must contain: its text without a think block."""
    text = "".join(c for c in message.content if isinstance(c, str))
    return re.sub(r"(?s)^.*</think>", "", text).strip()


def render(tokenizer, template: FolderTemplate, messages, key: str, tools: tuple[dict, ...] = (),
           *, supervise_empty_think: bool) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation (with `tools`) and its supervised character spans
    [(start, end), ...]; BadSampleError("template_mismatch") when the sample cannot be rendered
    and labelled."""
    def bad(why: str) -> BadSampleError:
        return BadSampleError("template_mismatch", f"{template.file}: {why} ({key})")

    for m in messages:
        for c in m.content:
            if isinstance(c, str) and ("<|im_start|>" in c or END in c):
                raise bad("message text holds <|im_start|> or <|im_end|>, which makes the "
                          "rendered turns ambiguous: remove them from the sample")
    import jinja2

    try:
        text = tokenizer.apply_chat_template(hf_messages(messages), chat_template=template.source,
                                             tools=list(tools) or None, tokenize=False,
                                             add_generation_prompt=False)
    except jinja2.TemplateError as e:
        raise bad(f"the template refuses the conversation: {e}") from None
    spans = []
    for header in re.finditer(re.escape(ASSISTANT_HEADER), text):
        start = header.end()
        end = text.find(END, start)
        if end < 0:
            raise bad(f"the template leaves an assistant turn without {END}; vlpack supervises "
                      "ChatML turns only")
        spans.append((start, end + len(END)))
    answers = [m for m in messages if m.role == "assistant"]
    if len(spans) != len(answers):
        raise bad(f"the template writes {len(spans)} assistant turns for {len(answers)} "
                  f"assistant messages; vlpack finds the supervised text by the "
                  f"{ASSISTANT_HEADER!r} header")
    for m, (a, b) in zip(answers, spans, strict=True):
        if _answer(m) not in text[a:b]:
            raise bad("the template does not write an answer's text into its assistant turn")
        if any(c.name not in text[a:b] for c in m.tool_calls):
            raise bad("the template does not write an assistant turn's tool calls into it")
    for tool in tools:
        if tool.get("function", tool)["name"] not in text:
            raise bad("the template does not write the tools (the `tools` of the sample)")
    spans = [(a + len(EMPTY_THINK) if not supervise_empty_think
              and text.startswith(EMPTY_THINK, a) else a, b)
             for m, (a, b) in zip(answers, spans, strict=True) if m.loss]
    for pad, kind, what in (("<|image_pad|>", ImageRef, "image"), ("<|video_pad|>", VideoRef,
                                                                     "video")):
        n = sum(1 for m in messages for c in m.content if isinstance(c, kind))
        if text.count(pad) != n:
            raise bad(f"the template writes {text.count(pad)} {what} placeholders for {n} "
                      f"{what}s")
    return text, spans
