"""The chat template `vlpack check --data` hands transformers' processor for a preset.

A preset has no checkpoint folder, so no template of its own: the reference renders with the
family's shipped Jinja (`vlpack.data.chat_templates.family_template`). That template writes no
tools, so for the families whose released template does (`Family.tool_format`: "json" for
Qwen3-VL, "xml" for Qwen3.5) the reference is a Jinja template written here after the released
ones' text: the tool preamble in the system turn, the calls after the answer, and a run of tool
results as one user turn of `<tool_response>` blocks (the format `vlpack.data.tools` documents).
It is a second implementation, in Jinja and rendered by transformers, of what vlpack's Python
writes; `tests/check/test_encoding.py` renders the hand-transcribed released text of
`tests/data/test_tools.py` with it.
"""

from __future__ import annotations

from vlpack.data.chat_templates import family_template
from vlpack.data.tools import _JSON_HEAD, _JSON_TAIL, _XML_HEAD, _XML_TAIL
from vlpack.families import family as family_of

_CONTENT = (
    '{% set NL = "\\n" %}'
    "{% macro render(content) %}"
    "{% if content is string %}{{ content }}"
    "{% else %}{% for c in content %}"
    "{% if c.type == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c.type == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% else %}{{ c.text }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% endmacro %}"
)
_TOOLS = "{% for t in tools %}{{ NL }}{{ t | tojson }}{% endfor %}{{ NL }}"
"""The schemas, one a line; the newline after them is written by the expression since
transformers' Jinja drops the first newline after a block tag."""
_RESULT = (  # a tool result: a run of them is one user turn
    "{% if loop.first or loop.previtem.role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ NL }}<tool_response>{{ NL }}{{ content }}{{ NL }}</tool_response>"
    "{% if loop.last or loop.nextitem.role != 'tool' %}<|im_end|>{{ NL }}{% endif %}"
)
_SKIP_SYSTEM = "{% if tools and loop.first and m.role == 'system' %}"

_JSON = _CONTENT + (
    "{% if tools %}<|im_start|>system{{ NL }}"
    "{% if messages and messages[0].role == 'system' %}{{ render(messages[0].content) }}"
    "{{ NL }}{{ NL }}{% endif %}" + _JSON_HEAD + _TOOLS + _JSON_TAIL[1:] + "<|im_end|>{{ NL }}"
    "{% endif %}"
    "{% for m in messages %}{% set content = render(m.content) %}"
    + _SKIP_SYSTEM + "{% elif m.role == 'tool' %}" + _RESULT + "{% else %}"
    "<|im_start|>{{ m.role }}{{ NL }}{{ content }}"
    "{% for c in m.tool_calls or [] %}"
    "{% if loop.index0 or content %}{{ NL }}{% endif %}"
    '<tool_call>{{ NL }}{"name": "{{ c.function.name }}", "arguments": '
    "{{ c.function.arguments | tojson }}{{ '}' }}{{ NL }}</tool_call>"
    "{% endfor %}"
    "<|im_end|>{{ NL }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{{ NL }}{% endif %}"
)

_XML = _CONTENT + (
    "{% set ns = namespace(last=-1) %}"
    "{% for m in messages %}{% if m.role == 'user' %}{% set ns.last = loop.index0 %}"
    "{% endif %}{% endfor %}"
    "{% if tools %}<|im_start|>system{{ NL }}" + _XML_HEAD + _TOOLS + _XML_TAIL[1:] +
    "{% if messages and messages[0].role == 'system' %}"
    "{% set s = render(messages[0].content) | trim %}{% if s %}{{ NL }}{{ NL }}{{ s }}{% endif %}"
    "{% endif %}<|im_end|>{{ NL }}{% endif %}"
    "{% for m in messages %}{% set content = render(m.content) | trim %}"
    + _SKIP_SYSTEM + "{% elif m.role == 'tool' %}" + _RESULT +
    "{% elif m.role == 'assistant' %}"
    "{% set reasoning = '' %}{% set answer = content %}"
    "{% if '</think>' in content %}"
    "{% set reasoning = content.split('</think>')[0].rstrip(NL).split('<think>')[-1]"
    ".lstrip(NL) | trim %}"
    "{% set answer = content.split('</think>')[-1].lstrip(NL) %}"
    "{% endif %}"
    "{% if m.reasoning_content is defined and m.reasoning_content is not none %}"
    "{% set reasoning = m.reasoning_content | trim %}{% set answer = content %}"
    "{% endif %}"
    "<|im_start|>assistant{{ NL }}"
    "{% if loop.index0 > ns.last %}<think>{{ NL }}{{ reasoning }}{{ NL }}</think>{{ NL }}{{ NL }}"
    "{% endif %}{{ answer }}"
    "{% for c in m.tool_calls or [] %}"
    "{% if not loop.first %}{{ NL }}{% elif answer | trim %}{{ NL }}{{ NL }}{% endif %}"
    "<tool_call>{{ NL }}<function={{ c.function.name }}>{{ NL }}"
    "{% for k, v in c.function.arguments.items() %}<parameter={{ k }}>{{ NL }}"
    "{% if v is mapping or (v is sequence and v is not string) %}{{ v | tojson }}"
    "{% else %}{{ v | string }}{% endif %}{{ NL }}</parameter>{{ NL }}{% endfor %}"
    "</function>{{ NL }}</tool_call>"
    "{% endfor %}"
    "<|im_end|>{{ NL }}"
    "{% elif m.role != 'system' or content %}"
    "<|im_start|>{{ m.role }}{{ NL }}{{ content }}<|im_end|>{{ NL }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{{ NL }}{% endif %}"
)


def reference_template(family: str) -> str:
    """The Jinja template transformers renders a preset's conversations with: the family's
    shipped template, or for a family whose released template writes tools, this module's."""
    fmt = family_of(family).tool_format
    return {"json": _JSON, "xml": _XML}.get(fmt) or family_template(family)
