"""Each family's chat template as Jinja (`vlpack.data.chat_templates`), the one a preset run's
export carries."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.data.test_tools import AGENT, EXPECTED, WEATHER, _call
from vlpack.data.loader import open_dataset


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl", "qwen3_5"])
def test_the_family_chat_template_renders_as_the_builtin_one(family: str) -> None:
    """The Jinja template a preset run's export carries gives the ids and labels of vlpack's
    built-in rendering: default system turn (qwen2), stripped content, skipped empty system
    turn and think blocks after the last user turn (qwen3.5)."""
    from vlpack.data.chat_templates import family_template
    from vlpack.data.encode import Encoder
    from vlpack.data.template import FolderTemplate
    from vlpack.data.types import Conversation, Message

    items = open_dataset("synthetic", None, synthetic_samples=24)[:3]
    user = items[0].messages[0]
    reasoning = Conversation(key="r", messages=(
        Message("system", (" ",)), user, Message("assistant", ("<think>\nhmm\n</think>\n\n3",)),
        Message("user", (" and? ",)), Message("assistant", ("<think>x</think>four ",))))
    builtin = Encoder(family, min_pixels=16384, max_pixels=50176)
    jinja = Encoder(family, min_pixels=16384, max_pixels=50176,
                    chat_template=FolderTemplate(family_template(family), "family.jinja"))
    for conv in [*items, reasoning]:
        a, b = builtin.encode(conv), jinja.encode(conv)
        assert np.array_equal(a.input_ids, b.input_ids), (conv.key, builtin.tokenizer.decode(
            b.input_ids[:40]))
        assert np.array_equal(a.labels, b.labels), conv.key


_THINK_AND_CALL = {"tools": [WEATHER], "messages": [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "reasoning_content": "Ask the tool.",
     "tool_calls": [_call("get_weather", {"city": "Paris", "when": ["now", 1], "ok": True})]},
    {"role": "tool", "content": "18 C"},
    {"role": "assistant", "content": "<think>\nIt is warm.\n</think>\n\nParis: 18 C."}]}  # fmt: skip


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5"])
@pytest.mark.parametrize("record", [AGENT, _THINK_AND_CALL], ids=["agent", "think_and_call"])
def test_the_exported_template_writes_tools_and_reasoning(family: str, record: dict,
                                                          tmp_path: Path) -> None:
    """A preset run's exported `chat_template.jinja`, rendered by transformers'
    `apply_chat_template` with the tools, gives vlpack's built-in ids token for token (tools in
    the system turn, calls, a run of tool results as one user turn, think blocks after the last
    user turn), and, as the run's template, the same labels."""
    from vlpack.config import load_config
    from vlpack.data.encode import Encoder
    from vlpack.data.media import DataFile
    from vlpack.data.sources import parse_record
    from vlpack.data.template import FolderTemplate, hf_messages
    from vlpack.train.run.serving import write_serving_files

    write_serving_files(tmp_path, load_config("tiny"), family)
    source = (tmp_path / "chat_template.jinja").read_text()
    conv = parse_record(record, file=DataFile(tmp_path), key="k")
    builtin = Encoder(family).encode(conv)
    tok = Encoder(family).tokenizer
    text = tok.apply_chat_template(hf_messages(conv.messages), tools=list(conv.tools),
                                   chat_template=source, tokenize=False)
    assert tok(text, add_special_tokens=False)["input_ids"] == builtin.input_ids.tolist(), text
    if record is AGENT:  # the released template's text (tests/data/test_tools.py)
        assert text == EXPECTED[family][0]
    elif family == "qwen3_5":  # both think blocks follow the last user turn
        assert "<think>\nAsk the tool.\n</think>\n\n<tool_call>" in text
        assert "<think>\nIt is warm.\n</think>\n\nParis: 18 C.<|im_end|>" in text
    jinja = Encoder(family, chat_template=FolderTemplate(source, "chat_template.jinja"))
    assert np.array_equal(jinja.encode(conv).labels, builtin.labels)
