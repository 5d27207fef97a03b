"""Each family's chat template as Jinja, for exported folders of runs trained without one.

A run on a preset (or a folder without a template) renders its samples with vlpack's built-in
template (data/encode.py); its exported folder carries this Jinja source, which renders the same
text for conversations of system, user, assistant and tool turns with images, videos, tools,
tool calls and reasoning, so a serving engine prompts the model as it was trained
(tests/data/test_chat_templates.py renders both ways and compares the token ids and labels).
What it writes, per family:

- every turn `<|im_start|>{role}\\n{content}<|im_end|>\\n`; an image
  `<|vision_start|><|image_pad|><|vision_end|>`, a video the same with `<|video_pad|>` (the
  processor expands the pads);
- qwen2_vl / qwen2_5_vl: the system turn "You are a helpful assistant." when the first message
  is not a system message; tools and calls are not written (vlpack refuses samples with them);
- qwen3_vl: given `tools`, the system turn with the tool preamble and JSON calls
  (`<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`), as data/tools.py's "json";
- qwen3_5 / qwen3_5_moe: each message's content stripped, an empty system turn skipped,
  `<think>\\n{reasoning}\\n</think>\\n\\n` before every answer after the last user turn that
  asks something (`reasoning_content`, else the answer's own think block), and the XML tool
  preamble and calls, as data/tools.py's "xml";
- qwen3 families: a run of tool results as one user turn of `<tool_response>` blocks;
- `add_generation_prompt`: `<|im_start|>assistant\\n`.
"""

from __future__ import annotations

import json

from vlpack.data import tools
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

_RESULT = (  # a tool result; a run of them is one user turn (data/tools.py)
    "{% macro result(m, text) %}"
    "{% if not m.prev or m.prev.role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ NL }}<tool_response>{{ NL }}{{ text }}{{ NL }}</tool_response>"
    "{% if not m.next or m.next.role != 'tool' %}<|im_end|>{{ NL }}{% endif %}"
    "{% endmacro %}"
)

_SCHEMAS = "{% for t in tools %}{{ NL }}{{ t | tojson }}{% endfor %}"


def _literal(text: str) -> str:
    """`text` as a Jinja string expression."""
    return "{{ " + json.dumps(text) + " }}"


_QWEN3 = _CONTENT + _RESULT + (
    "{% set msgs = messages %}"
    "{% if tools %}"
    "<|im_start|>system{{ NL }}"
    "{% if messages and messages[0].role == 'system' %}"
    "{{ render(messages[0].content) }}{{ NL }}{{ NL }}{% set msgs = messages[1:] %}"
    "{% endif %}"
    + _literal(tools.preamble("json")[0]) + _SCHEMAS + _literal(tools.preamble("json")[1])
    + "<|im_end|>{{ NL }}"
    "{% endif %}"
    "{% for m in msgs %}"
    "{% if m.role == 'tool' %}"
    "{{ result({'prev': loop.previtem, 'next': loop.nextitem}, render(m.content)) }}"
    "{% else %}"
    "{% set text = render(m.content) %}"
    "<|im_start|>{{ m.role }}{{ NL }}{{ text }}"
    "{% for c in m.tool_calls or [] %}"
    "{% set c = c.function or c %}"
    "{% if not loop.first or text %}{{ NL }}{% endif %}"
    '<tool_call>{{ NL }}{"name": "{{ c.name }}", "arguments": '
    "{% if c.arguments is string %}{{ c.arguments }}{% else %}{{ c.arguments | tojson }}{% endif %}"
    "}{{ NL }}</tool_call>"
    "{% endfor %}"
    "<|im_end|>{{ NL }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{{ NL }}{% endif %}"
)

_QWEN3_5 = _CONTENT + _RESULT + (
    "{% set msgs = messages %}"
    "{% if tools %}"
    "<|im_start|>system{{ NL }}"
    + _literal(tools.preamble("xml")[0]) + _SCHEMAS + _literal(tools.preamble("xml")[1])
    + "{% if messages and messages[0].role == 'system' %}"
    "{% set system = render(messages[0].content) | trim %}"
    "{% if system %}{{ NL }}{{ NL }}{{ system }}{% endif %}{% set msgs = messages[1:] %}"
    "{% endif %}"
    "<|im_end|>{{ NL }}"
    "{% endif %}"
    # the last user message that asks something (not one wrapping a tool result)
    "{% set ns = namespace(last=-1) %}"
    "{% for m in msgs %}{% set t = render(m.content) | trim %}"
    "{% if m.role == 'user' and not (t.startswith('<tool_response>')"
    " and t.endswith('</tool_response>')) %}{% set ns.last = loop.index0 %}{% endif %}"
    "{% endfor %}"
    "{% for m in msgs %}"
    "{% set content = render(m.content) | trim %}"
    "{% if m.role == 'tool' %}"
    "{{ result({'prev': loop.previtem, 'next': loop.nextitem}, content) }}"
    "{% elif m.role == 'assistant' %}"
    "{% set reasoning = '' %}{% set answer = content %}"
    "{% if m.reasoning_content is string %}{% set reasoning = m.reasoning_content | trim %}"
    "{% elif '</think>' in content %}"
    "{% set reasoning = content.split('</think>')[0].rstrip(NL).split('<think>')[-1]"
    ".lstrip(NL) | trim %}"
    "{% set answer = content.split('</think>')[-1].lstrip(NL) %}"
    "{% endif %}"
    "<|im_start|>assistant{{ NL }}"
    "{% if loop.index0 > ns.last %}<think>{{ NL }}{{ reasoning }}{{ NL }}</think>{{ NL }}{{ NL }}{% endif %}"
    "{{ answer }}"
    "{% for c in m.tool_calls or [] %}"
    "{% set c = c.function or c %}"
    "{% if not loop.first %}{{ NL }}{% elif answer | trim %}{{ NL }}{{ NL }}{% endif %}"
    "<tool_call>{{ NL }}<function={{ c.name }}>{{ NL }}"
    "{% for k, v in c.arguments.items() %}"
    "<parameter={{ k }}>{{ NL }}"
    "{% if v is mapping or (v is iterable and v is not string) %}{{ v | tojson }}"
    "{% else %}{{ v | string }}{% endif %}"
    "{{ NL }}</parameter>{{ NL }}"
    "{% endfor %}"
    "</function>{{ NL }}</tool_call>"
    "{% endfor %}"
    "<|im_end|>{{ NL }}"
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
