"""Each family's chat template as Jinja, for exported folders of runs trained without one.

A run on a preset (or a folder without a template) renders its samples with vlpack's built-in
template (data/encode.py); its exported folder carries this Jinja source, which renders the same
text for conversations of system, user and assistant turns with images and videos, so a serving
engine prompts the model as it was trained (tests/data/test_chat_templates.py renders both ways
and compares the token ids and labels). What it writes, per family:

- every turn `<|im_start|>{role}\\n{content}<|im_end|>\\n`; an image
  `<|vision_start|><|image_pad|><|vision_end|>`, a video the same with `<|video_pad|>` (the
  processor expands the pads);
- qwen2_vl / qwen2_5_vl: the system turn "You are a helpful assistant." when the first message
  is not a system message;
- qwen3_5 / qwen3_5_moe: each message's content stripped, an empty system turn skipped, and
  `<think>\\n{reasoning}\\n</think>\\n\\n` before every answer after the last user turn;
- `add_generation_prompt`: `<|im_start|>assistant\\n`.

Tools and tool calls are not written: a run that trains with them should train with a template
that writes them (`data.chat_template=FILE.jinja`), which then travels to its export.
"""

from __future__ import annotations

from vlpack.families import family as family_of

_CONTENT = (
    '{% set NL = "\\n" %}'
    "{% macro render(content) %}"
    "{% if content is string %}{{ content }}"
    "{% else %}{% for c in content %}"
    "{% if c.type == 'image' or 'image' in c %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c.type == 'video' or 'video' in c %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% else %}{{ c.text }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% endmacro %}"
)

_QWEN2 = _CONTENT + (
    "{% if not messages or messages[0].role != 'system' %}"
    "<|im_start|>system{{ NL }}You are a helpful assistant.<|im_end|>{{ NL }}"
    "{% endif %}"
    "{% for m in messages %}"
    "<|im_start|>{{ m.role }}{{ NL }}{{ render(m.content) }}<|im_end|>{{ NL }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{{ NL }}{% endif %}"
)

_QWEN3 = _CONTENT + (
    "{% for m in messages %}"
    "<|im_start|>{{ m.role }}{{ NL }}{{ render(m.content) }}<|im_end|>{{ NL }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{{ NL }}{% endif %}"
)

_QWEN3_5 = _CONTENT + (
    "{% set ns = namespace(last=-1) %}"
    "{% for m in messages %}{% if m.role == 'user' %}{% set ns.last = loop.index0 %}"
    "{% endif %}{% endfor %}"
    "{% for m in messages %}"
    "{% set content = render(m.content) | trim %}"
    "{% if m.role == 'assistant' %}"
    "{% set reasoning = '' %}{% set answer = content %}"
    "{% if '</think>' in content %}"
    "{% set reasoning = content.split('</think>')[0].rstrip(NL).split('<think>')[-1]"
    ".lstrip(NL) | trim %}"
    "{% set answer = content.split('</think>')[-1].lstrip(NL) %}"
    "{% endif %}"
    "<|im_start|>assistant{{ NL }}"
    "{% if loop.index0 > ns.last %}<think>{{ NL }}{{ reasoning }}{{ NL }}</think>{{ NL }}{{ NL }}{% endif %}"
    "{{ answer }}<|im_end|>{{ NL }}"
    "{% elif m.role != 'system' or content %}"
    "<|im_start|>{{ m.role }}{{ NL }}{{ content }}<|im_end|>{{ NL }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{{ NL }}{% endif %}"
)


def family_template(family: str) -> str:
    """The Jinja chat template that renders `family`'s conversations as vlpack's built-in
    template does (module docstring)."""
    f = family_of(family)
    if f.think_prefix:
        return _QWEN3_5
    return _QWEN2 if f.default_system else _QWEN3
