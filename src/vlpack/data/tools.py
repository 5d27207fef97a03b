"""Tools and tool calls as each family's released chat template writes them (`Family.tool_format`).

- "json" (Qwen3-VL): with tools, the system turn holds the system message's text and `\\n\\n`
  (when there is a system message), then the tool preamble with one JSON schema per line inside
  `<tools>`; each call of an assistant turn is `<tool_call>\\n{"name": "NAME", "arguments":
  ARGS}\\n</tool_call>` after its text, with `\\n` before it unless it is the first call of a
  turn without text.
- "xml" (Qwen3.5): the system turn holds the tool preamble, then `\\n\\n` and the system
  message's text when it is not empty; each call is `<tool_call>\\n<function=NAME>\\n`, one
  `<parameter=KEY>\\nVALUE\\n</parameter>\\n` per argument, then `</function>\\n</tool_call>`;
  `\\n\\n` goes before the first call of a turn with text, `\\n` before later calls. A value that
  is an object or a list is written as JSON, any other as Python's `str` of it (Jinja's `string`
  filter: `True`, `None`, `1.5`).
- Both write a run of consecutive tool results as one user turn: `<|im_start|>user`, then
  `\\n<tool_response>\\n{result}\\n</tool_response>` per result, then `<|im_end|>\\n`.
- None (Qwen2-VL, Qwen2.5-VL): the template writes neither tools nor calls (a sample with them
  is refused, since its calls would vanish from training); a tool result is its own
  `<|im_start|>tool\\n{result}<|im_end|>\\n` turn, as any role is.

JSON is transformers' `tojson` filter: `json.dumps(x, ensure_ascii=False)`, keys in the order given.
"""

from __future__ import annotations

import json
from typing import Any

from vlpack.data.types import ToolCall

_JSON_HEAD = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
              "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
_JSON_TAIL = ("\n</tools>\n\nFor each function call, return a json object with function name and "
              "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
              '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
_XML_HEAD = "# Tools\n\nYou have access to the following functions:\n\n<tools>"
_XML_TAIL = (
    "\n</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO "
    "suffix:\n\n<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\n"
    "value_1\n</parameter>\n<parameter=example_parameter_2>\nThis is the value for the second "
    "parameter\nthat can span\nmultiple lines\n</parameter>\n</function>\n</tool_call>\n\n"
    "<IMPORTANT>\nReminder:\n- Function calls MUST follow the specified format: an inner "
    "<function=...></function> block must be nested within <tool_call></tool_call> XML tags\n"
    "- Required parameters MUST be specified\n- You may provide optional reasoning for your "
    "function call in natural language BEFORE the function call, but NOT after\n- If there is no "
    "function call available, answer the question like normal with your current knowledge and "
    "do not tell the user about function calls\n</IMPORTANT>"
)
FORMATS = ("json", "xml")


def tojson(value: Any) -> str:
    """`value` as transformers' chat templates write JSON."""
    return json.dumps(value, ensure_ascii=False)


def preamble(fmt: str) -> tuple[str, str]:
    """The tool preamble of format `fmt`: its text before and after the schemas."""
    return (_JSON_HEAD, _JSON_TAIL) if fmt == "json" else (_XML_HEAD, _XML_TAIL)


def system_text(fmt: str, tools: tuple[dict, ...], system: str | None) -> str:
    """The text of the system turn (between `<|im_start|>system\\n` and `<|im_end|>`) of a
    conversation with `tools`; `system` is the system message's text (trimmed for "xml", as
    that template trims every message), None without one."""
    schemas = "".join("\n" + tojson(t) for t in tools)
    if fmt == "json":
        return ("" if system is None else system + "\n\n") + _JSON_HEAD + schemas + _JSON_TAIL
    return _XML_HEAD + schemas + _XML_TAIL + (f"\n\n{system}" if system else "")


def calls_text(fmt: str, calls: tuple[ToolCall, ...], answer: str) -> str:
    """The text that an assistant turn's `calls` add after its `answer` text."""
    out = []
    for j, call in enumerate(calls):
        if fmt == "json":
            sep = "\n" if j or answer else ""
            out.append(f'{sep}<tool_call>\n{{"name": "{call.name}", "arguments": '
                       f"{tojson(call.arguments)}}}\n</tool_call>")
        else:
            sep = "\n" if j else "\n\n" if answer.strip() else ""
            params = "".join(f"<parameter={k}>\n{_value(v)}\n</parameter>\n"
                             for k, v in call.arguments.items())
            out.append(f"{sep}<tool_call>\n<function={call.name}>\n{params}</function>\n"
                       "</tool_call>")
    return "".join(out)


def _value(value: Any) -> str:
    """An argument's value as the "xml" template writes it."""
    return tojson(value) if isinstance(value, dict | list) else str(value)
