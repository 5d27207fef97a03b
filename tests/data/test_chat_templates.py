"""Each family's chat template as Jinja (`vlpack.data.chat_templates`), the one a preset run's
export carries."""

from __future__ import annotations

import numpy as np
import pytest

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
