"""Re-derive `tests/data/test_tools.py`'s EXPECTED from the released chat templates.

    python -m tests.tool_templates_reference QWEN3_VL_TEMPLATE.jinja QWEN3_5_TEMPLATE.jinja

Pass the `chat_template.jinja` of a Qwen3-VL Instruct checkpoint and of a Qwen3.5 checkpoint
(local files: nothing is downloaded). Each template renders the test's AGENT conversation with
transformers' `apply_chat_template(..., tools=...)`; the script prints the text and says whether it
equals the test's literal and vlpack's built-in encoding, token for token. Exit status 1 on any
difference.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from tests.data.test_tools import AGENT, EXPECTED
from vlpack.data.encode import Encoder
from vlpack.data.media import DataFile
from vlpack.data.sources import parse_record
from vlpack.data.template import hf_messages


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__)
        return 2
    ok = True
    for family, path in zip(("qwen3_vl", "qwen3_5"), argv, strict=True):
        conv = parse_record(AGENT, file=DataFile(Path(tempfile.gettempdir())), key="k")
        enc = Encoder(family)
        text = enc.tokenizer.apply_chat_template(
            hf_messages(conv.messages), tools=list(conv.tools), tokenize=False,
            chat_template=Path(path).read_text())
        ids = enc.tokenizer(text, add_special_tokens=False)["input_ids"]
        literal, builtin = text == EXPECTED[family][0], ids == enc.encode(conv).input_ids.tolist()
        print(f"{family} ({path}):\n{text!r}\nequals the test's literal: {literal}; vlpack's "
              f"built-in encoding: {builtin}")
        ok &= literal and builtin
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
