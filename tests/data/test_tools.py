"""Agent and tool-call conversations: `tools`, `tool` turns and `tool_calls` rendered as each
family's released chat template renders them, per-turn loss masks, the empty think block, bad
schemas, and `vlpack check --data` on a tool-call file."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from vlpack.config import DataConfig
from vlpack.data.encode import Encoder
from vlpack.data.media import DataFile
from vlpack.data.sources import parse_record
from vlpack.data.types import IGNORE_INDEX, BadSampleError

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}  # fmt: skip


def _call(name: str, arguments) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


AGENT = {"tools": [WEATHER], "messages": [
    {"role": "system", "content": "You help."},
    {"role": "user", "content": "Weather in Paris and Oslo?"},
    {"role": "assistant", "content": "Checking.", "tool_calls": [
        _call("get_weather", {"city": "Paris"}),
        _call("get_weather", '{"city": "Oslo", "days": 2}')]},  # OpenAI's string arguments
    {"role": "tool", "content": "18 C"},
    {"role": "tool", "content": "rain"},
    {"role": "assistant", "content": "Paris 18 C, Oslo rain."}]}  # fmt: skip

_SCHEMA = ('{"type": "function", "function": {"name": "get_weather", "description": "Weather in '
           'a city", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, '
           '"required": ["city"]}}}')
_RESULTS = ("<|im_start|>user\n<tool_response>\n18 C\n</tool_response>\n<tool_response>\nrain\n"
            "</tool_response><|im_end|>\n")
# What the released templates render for AGENT (hand-transcribed from Qwen3-VL-*-Instruct's and
# Qwen3.5's chat_template.jinja; `python -m tests.tool_templates_reference VL.jinja 3_5.jinja`
# renders those files with transformers and compares).
EXPECTED = {
    "qwen3_vl": (
        "<|im_start|>system\nYou help.\n\n# Tools\n\nYou may call one or more functions to assist "
        "with the user query.\n\nYou are provided with function signatures within <tools></tools> "
        f"XML tags:\n<tools>\n{_SCHEMA}\n</tools>\n\nFor each function call, return a json object "
        "with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nWeather in Paris and Oslo?<|im_end|>\n<|im_start|>assistant\n"
        "Checking.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n'
        '{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>'
        "<|im_end|>\n" + _RESULTS + "<|im_start|>assistant\nParis 18 C, Oslo rain.<|im_end|>\n",
        ['Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
         '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", '
         '"days": 2}}\n</tool_call><|im_end|>', "Paris 18 C, Oslo rain.<|im_end|>"]),
    "qwen3_5": (
        "<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n"
        f"{_SCHEMA}\n</tools>\n\nIf you choose to call a function ONLY reply in the following "
        "format with NO suffix:\n\n<tool_call>\n<function=example_function_name>\n"
        "<parameter=example_parameter_1>\nvalue_1\n</parameter>\n<parameter=example_parameter_2>\n"
        "This is the value for the second parameter\nthat can span\nmultiple lines\n</parameter>\n"
        "</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n- Function calls MUST follow the "
        "specified format: an inner <function=...></function> block must be nested within "
        "<tool_call></tool_call> XML tags\n- Required parameters MUST be specified\n- You may "
        "provide optional reasoning for your function call in natural language BEFORE the "
        "function call, but NOT after\n- If there is no function call available, answer the "
        "question like normal with your current knowledge and do not tell the user about "
        "function calls\n</IMPORTANT>\n\nYou help.<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris and Oslo?<|im_end|>\n<|im_start|>assistant\n"
        "<think>\n\n</think>\n\nChecking.\n\n<tool_call>\n<function=get_weather>\n"
        "<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
        "<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n<parameter=days>\n2\n"
        "</parameter>\n</function>\n</tool_call><|im_end|>\n" + _RESULTS
        + "<|im_start|>assistant\n<think>\n\n</think>\n\nParis 18 C, Oslo rain.<|im_end|>\n",
        ["<think>\n\n</think>\n\nChecking.\n\n<tool_call>\n<function=get_weather>\n"
         "<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
         "<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n<parameter=days>\n2\n"
         "</parameter>\n</function>\n</tool_call><|im_end|>",
         "<think>\n\n</think>\n\nParis 18 C, Oslo rain.<|im_end|>"]),
}  # fmt: skip


def _runs(enc: Encoder, sample) -> list[str]:
    """The supervised token runs of `sample`, decoded."""
    sup = np.flatnonzero(sample.labels != IGNORE_INDEX)
    assert (sample.labels[sup] == sample.input_ids[sup]).all()
    runs = np.split(sup, np.flatnonzero(np.diff(sup) > 1) + 1) if len(sup) else []
    return [enc.tokenizer.decode(sample.input_ids[r]) for r in runs]


def _record(messages: list[dict], **extra) -> dict:
    return {"messages": messages, **extra}


@pytest.mark.parametrize("family", sorted(EXPECTED))
def test_builtin_template_writes_tools_as_the_released_one(family, tmp_path):
    """The built-in rendering of a conversation with tools, two calls (object and JSON-string
    arguments) and two results is the released template's text, token for token; the labels
    are each answer with its calls and <|im_end|>, and nothing of the tools or the results."""
    enc = Encoder(family)
    sample = enc.encode(parse_record(AGENT, file=DataFile(tmp_path), key="k"))
    text, supervised = EXPECTED[family]
    assert sample.input_ids.tolist() == enc.tokenizer.encode(text, add_special_tokens=False)
    assert _runs(enc, sample) == supervised


def test_qwen2_families_refuse_tools_and_keep_tool_turns(tmp_path):
    """Qwen2/2.5-VL's template writes neither tools nor calls: a sample with them is a named bad
    sample; a tool result (calls written in the answer text) is its own `tool` turn there, and
    a run of results is one user turn in the Qwen3 families."""
    for family in ("qwen2_vl", "qwen2_5_vl"):
        with pytest.raises(BadSampleError, match=r"k: the qwen2.*writes neither tools") as e:
            Encoder(family).encode(parse_record(AGENT, file=DataFile(tmp_path), key="k"))
        assert e.value.reason == "tools_unsupported"
    rec = _record([{"role": "user", "content": "q"},
                   {"role": "assistant", "content": "<tool_call>f</tool_call>"},
                   {"role": "tool", "content": "r"}, {"role": "assistant", "content": "a"}])
    conv = parse_record(rec, file=DataFile(tmp_path), key="k")
    for family, result in (("qwen2_vl", "<|im_start|>tool\nr<|im_end|>\n"),
                           ("qwen3_vl", "<|im_start|>user\n<tool_response>\nr\n"
                                        "</tool_response><|im_end|>\n")):
        enc = Encoder(family)
        text = enc.tokenizer.decode(enc.encode(conv).input_ids)
        assert text.endswith("<tool_call>f</tool_call><|im_end|>\n" + result
                             + "<|im_start|>assistant\na<|im_end|>\n")
        assert _runs(enc, enc.encode(conv)) == ["<tool_call>f</tool_call><|im_end|>",
                                                "a<|im_end|>"]


_MASKED = _record([
    {"role": "user", "content": "Weather?"},
    {"role": "assistant", "content": "", "tool_calls": [_call("get_weather", {"city": "Rome"})]},
    {"role": "tool", "content": "sun"},
    {"role": "assistant", "content": "<think>\nIt said sun.\n</think>\n\nSunny.", "loss": False},
    {"role": "user", "content": "Thanks"},
    {"role": "assistant", "content": "You're welcome."}], tools=[WEATHER])  # fmt: skip


@pytest.mark.parametrize("supervise_empty_think", [True, False])
def test_loss_false_and_the_empty_think_block_in_the_labels(supervise_empty_think, tmp_path):
    """Hand-worked Qwen3.5 labels: the `"loss": false` answer has none, the tool result none,
    the calling turn (after the last user query before it) its think block, call and
    <|im_end|>; `supervise_empty_think=False` drops only the empty think blocks."""
    enc = Encoder("qwen3_5", supervise_empty_think=supervise_empty_think)
    sample = enc.encode(parse_record(_MASKED, file=DataFile(tmp_path), key="k"))
    text = enc.tokenizer.decode(sample.input_ids)
    assert text.endswith(
        "<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\n<tool_call>\n"
        "<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n</function>\n"
        "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nsun\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\nSunny.<|im_end|>\n<|im_start|>user\nThanks"
        "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nYou're welcome.<|im_end|>\n")
    think = "<think>\n\n</think>\n\n" if supervise_empty_think else ""
    assert _runs(enc, sample) == [
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n</function>\n"
        "</tool_call><|im_end|>", f"{think}You're welcome.<|im_end|>"]


def test_a_reasoning_block_stays_supervised_without_the_empty_one(tmp_path):
    """`supervise_empty_think=False` keeps a think block that holds reasoning."""
    rec = _record([{"role": "user", "content": "q"},
                   {"role": "assistant", "content": "<think>why</think>a"}])
    enc = Encoder("qwen3_5", supervise_empty_think=False)
    sample = enc.encode(parse_record(rec, file=DataFile(tmp_path), key="k"))
    assert _runs(enc, sample) == ["<think>\nwhy\n</think>\n\na<|im_end|>"]


# A tool-aware folder template unlike the built-in ones: the tools as a bullet list in the system
# turn, each call as `CALL name(json)` lines, each result a `tool` turn.
_FOLDER = (
    "{%- if tools %}<|im_start|>system\nTools:\n{% for t in tools %}- {{ t.function.name }}: "
    "{{ t.function.parameters | tojson }}\n{% endfor %}<|im_end|>\n{% endif -%}"
    "{%- for m in messages -%}<|im_start|>{{ m.role }}\n"
    "{% if m.content is string %}{{ m.content }}{% else %}{% for c in m.content %}"
    "{% if c.type == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ c.text }}"
    "{% endif %}{% endfor %}{% endif %}"
    "{%- for c in m.tool_calls or [] %}{{ '\\n' }}CALL {{ c.function.name }}"
    "({{ c.function.arguments | tojson }}){% endfor %}<|im_end|>\n{% endfor -%}"
)


def test_folder_template_with_tools_equals_transformers(tmp_path):
    """A checkpoint folder's tool-aware template: the encoder's ids are transformers'
    `apply_chat_template(messages, tools=...)` tokenised whole; the labels are the answers
    with their calls, the `"loss": false` one left out."""
    from transformers import AutoTokenizer

    from vlpack.data.template import load_template
    from vlpack.data.tokenizer import load_tokenizer

    tok = load_tokenizer("qwen3_vl")
    tok.chat_template = _FOLDER
    tok.save_pretrained(tmp_path)
    tok.chat_template = None
    rec = _record([
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Let me see.",
         "tool_calls": [_call("get_weather", {"city": "Rome"})]},
        {"role": "tool", "content": "sun"},
        {"role": "assistant", "content": "Sunny.", "loss": False},
        {"role": "user", "content": "And Oslo?"},
        {"role": "assistant", "content": None,
         "tool_calls": [_call("get_weather", '{"city": "Oslo"}')]},
        {"role": "tool", "content": "rain"},
        {"role": "assistant", "content": "Rain."}], tools=[WEATHER])  # fmt: skip
    enc = Encoder("qwen3_vl", tokenizer_path=str(tmp_path),
                  chat_template=load_template("auto", tmp_path))
    got = enc.encode(parse_record(rec, file=DataFile(tmp_path), key="k"))
    ref = AutoTokenizer.from_pretrained(tmp_path)
    messages = [{k: v for k, v in m.items() if k != "loss"} for m in rec["messages"]]
    messages[5] = {**messages[5], "content": "",
                   "tool_calls": [_call("get_weather", {"city": "Oslo"})]}
    text = ref.apply_chat_template(messages, tools=[WEATHER], tokenize=False)
    assert "- get_weather: {" in text and 'CALL get_weather({"city": "Oslo"})' in text
    assert got.input_ids.tolist() == ref(text, add_special_tokens=False)["input_ids"]
    assert _runs(enc, got) == [
        'Let me see.\nCALL get_weather({"city": "Rome"})<|im_end|>',
        # the header's "\n" and the call's are one token, which the answer needs: supervised
        '\n\nCALL get_weather({"city": "Oslo"})<|im_end|>', "Rain.<|im_end|>"]


def test_a_folder_template_that_drops_tools_or_calls_is_a_bad_sample(tmp_path):
    """A template that writes no tools, or no tool calls (as Qwen2-VL's), would train the calls
    away: the sample is `template_mismatch`, naming the template."""
    from vlpack.data.template import load_template

    plain = tmp_path / "plain.jinja"
    plain.write_text("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is string %}"
                     "{{ m.content }}{% else %}{% for c in m.content %}{% if c.type == 'image' %}"
                     "<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ c.text }}{% endif %}"
                     "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}")
    enc = Encoder("qwen3_vl", chat_template=load_template(str(plain), None))
    calls = [{"role": "user", "content": "q"},
             {"role": "assistant", "content": "x", "tool_calls": [_call("get_weather", {})]},
             {"role": "tool", "content": "r"}, {"role": "assistant", "content": "a"}]
    for rec, match in ((_record(calls), "does not write an assistant turn's tool calls"),
                       (_record([*calls[:1], {"role": "assistant", "content": "a"}],
                                tools=[WEATHER]), "does not write the tools")):
        with pytest.raises(BadSampleError, match=r"plain\.jinja: the template " + match) as e:
            enc.encode(parse_record(rec, file=DataFile(tmp_path), key="k"))
        assert e.value.reason == "template_mismatch"


def test_sharegpt_tool_turns_encode_as_messages(tmp_path):
    """The ShareGPT form (`function_call` and `observation` turns, `tools` as a JSON string, a
    `loss` key on a turn) encodes exactly as the messages form."""
    sharegpt = {"tools": json.dumps([WEATHER]), "conversations": [
        {"from": "human", "value": "Weather?"},
        {"from": "function_call", "value": json.dumps({"name": "get_weather",
                                                       "arguments": {"city": "Rome"}})},
        {"from": "observation", "value": "sun"},
        {"from": "gpt", "value": "Sunny.", "loss": False},
        {"from": "human", "value": "Thanks"},
        {"from": "gpt", "value": "You're welcome."}]}  # fmt: skip
    messages = {k: v for k, v in _MASKED.items()}
    messages["messages"] = [*_MASKED["messages"][:3],
                            {"role": "assistant", "content": "Sunny.", "loss": False},
                            *_MASKED["messages"][4:]]
    enc = Encoder("qwen3_5")
    a = enc.encode(parse_record(sharegpt, file=DataFile(tmp_path), key="k"))
    b = enc.encode(parse_record(messages, file=DataFile(tmp_path), key="k"))
    assert a.input_ids.tolist() == b.input_ids.tolist()
    assert a.labels.tolist() == b.labels.tolist()


_USER = {"role": "user", "content": "q"}
_ANSWER = {"role": "assistant", "content": "a"}


@pytest.mark.parametrize(("record", "reason", "match"), [
    (_record([_USER, _ANSWER], tools={"name": "f"}), "bad_tools",
     r'k: "tools" must be a list of function schemas, got dict'),
    (_record([_USER, _ANSWER], tools="[{"), "bad_tools",
     r'k: "tools" \(a string\) is not usable JSON \(Expecting'),
    (_record([_USER, _ANSWER], tools=[WEATHER, {"type": "function", "function": {}}]),
     "bad_tools", r"k: tools\[1\] has no function name"),
    (_record([_USER, _ANSWER], tools=[{"name": "f", "parameters": ["city"]}]), "bad_tools",
     r'k: tools\[0\] \(f\): "parameters" must be a JSON schema object'),
    (_record([_USER, _ANSWER], tools=[{"name": "f", "parameters": {"properties": []}}]),
     "bad_tools", r"k: tools\[0\] \(f\): .*\"properties\" object"),
    (_record([_USER, {"role": "assistant", "content": None, "tool_calls": [
        _call("get_weather", "{city: Rome}")]}, {"role": "tool", "content": "r"}, _ANSWER]),
     "bad_tool_call",
     r"k: turn 1, call 0 \(get_weather\): its arguments string is not usable JSON \(Expecting"),
    (_record([_USER, {"role": "assistant", "content": "", "tool_calls": [
        _call("get_weather", [1])]}, {"role": "tool", "content": "r"}, _ANSWER]),
     "bad_tool_call", r"k: turn 1, call 0 \(get_weather\): arguments must be a JSON object"),
    (_record([_USER, {"role": "assistant", "content": "", "tool_calls": [{"function": {}}]},
              _ANSWER]), "bad_tool_call", r"k: turn 1, call 0 has no function name"),
    (_record([_USER, {"role": "assistant", "content": "", "tool_calls": [_call("nope", {})]},
              {"role": "tool", "content": "r"}, _ANSWER], tools=[WEATHER]), "bad_tool_call",
     r"k: turn 1 calls 'nope', which is not in the record's tools \(get_weather\)"),
    (_record([_USER, {"role": "tool", "content": "r"}, _ANSWER]), "bad_schema",
     r"k: tool turn 1 answers no call"),
    (_record([_USER, {"role": "assistant", "content": "", "tool_calls": [_call("f", {})]},
              {"role": "tool", "content": "r"}]), "bad_schema", r"ends with a tool turn"),
    (_record([_USER, {**_ANSWER, "loss": False}]), "no_supervised_turn",
     r'k: every assistant turn has "loss": false'),
    (_record([{**_USER, "loss": True}, _ANSWER]), "bad_schema",
     r'k: turn 0 is a user turn with "loss": true'),
    (_record([_USER, {**_ANSWER, "loss": "no"}]), "bad_schema",
     r'k: turn 1: "loss" must be true or false'),
    (_record([{**_USER, "tool_calls": [_call("f", {})]}, _ANSWER]), "bad_tool_call",
     r"k: turn 0: a user turn has tool_calls"),
])  # fmt: skip
def test_bad_tool_data_is_a_named_bad_sample(record, reason, match, tmp_path):
    with pytest.raises(BadSampleError, match=match) as e:
        parse_record(record, file=DataFile(tmp_path), key="k")
    assert e.value.reason == reason


def test_special_tokens_in_tool_calls_or_tools_are_refused(tmp_path):
    """A call's arguments or the tools holding `<|im_end|>` would forge a turn boundary."""
    enc = Encoder("qwen3_vl")
    forged = _record([_USER, {"role": "assistant", "content": "", "tool_calls": [
        _call("get_weather", {"city": "<|im_end|>"})]}, {"role": "tool", "content": "r"},
        _ANSWER])  # fmt: skip
    with pytest.raises(BadSampleError, match=re.escape("the assistant text of turn 1 holds "
                                                       "'<|im_end|>'")):
        enc.encode(parse_record(forged, file=DataFile(tmp_path), key="k"))
    tools = [{"name": "f", "description": "<|endoftext|>"}]
    with pytest.raises(BadSampleError, match=re.escape("k: the tools holds '<|endoftext|>'")):
        enc.encode(parse_record(_record([_USER, _ANSWER], tools=tools), file=DataFile(tmp_path),
                                key="k"))


def _tool_jsonl(folder) -> str:
    """A small agent dataset: calls and results, an image in a tool result, a masked answer."""
    from PIL import Image

    Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 96, 3), dtype=np.uint8)).save(
        folder / "shot.png")
    zoom = {"type": "function", "function": {"name": "screenshot", "parameters": {
        "type": "object", "properties": {"zoom": {"type": "number"}}}}}
    rows = [
        {"id": "weather", **AGENT},
        {"id": "screen", "tools": [zoom], "messages": [
            {"role": "user", "content": "What is on the screen?"},
            {"role": "assistant", "content": "", "tool_calls": [_call("screenshot", {"zoom": 2})]},
            {"role": "tool", "content": [{"type": "image", "image": "shot.png"},
                                         {"type": "text", "text": "zoomed"}]},
            {"role": "assistant", "content": "A receipt."}]},
        {"id": "masked", **_MASKED},
    ]  # fmt: skip
    path = folder / "agent.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_check_and_validate_pass_on_tool_call_data(tmp_path, capsys):
    """`vlpack data validate` finds every tool-call sample good (Qwen3-VL and Qwen3.5
    renderings); `vlpack check --data` packs them (an image in a tool result included) and
    proves packed == unpacked on the tiny Qwen3-VL."""
    from vlpack.cli import main
    from vlpack.data.validate import validate

    data = _tool_jsonl(tmp_path)
    for family in ("qwen3_vl", "qwen3_5"):
        report = validate(DataConfig(source="jsonl", path=data), family, workers=1)
        assert report["good"] == 3 and not report["problems"], report["problems"]
    args = ["check", "--model", "tiny-qwen3_vl", "--data", data, "--samples", "3", "--json"]
    assert main(args) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["passed"], r["failures"]
    assert sorted(r["sample_keys"]) == ["masked", "screen", "weather"]


def test_the_trainer_hands_supervise_empty_think_to_its_encoder(tmp_path):
    """`data.supervise_empty_think=false` reaches the encoder the trainer builds (default true)."""
    from tests.helpers import CPU, small_cfg
    from vlpack.train.trainer import Trainer

    assert small_cfg(tmp_path / "d").data.supervise_empty_think is True
    cfg = small_cfg(tmp_path / "run", "data.supervise_empty_think=false")
    assert Trainer(cfg, CPU).encoder.supervise_empty_think is False


def test_the_checks_transformers_reference_gets_the_tools(tmp_path):
    """`vlpack check --model FOLDER` compares the encoding with transformers' processor: that
    reference renders the folder's template with the sample's tools, so a tool-call sample
    gets the ids vlpack trains on."""
    from transformers import AutoConfig

    from vlpack.check.processor import _hf_inputs, build_processor
    from vlpack.data.processor import load_image_processor
    from vlpack.data.template import load_template
    from vlpack.data.tokenizer import load_tokenizer

    load_tokenizer("qwen3_vl").save_pretrained(tmp_path)
    load_image_processor("qwen3_vl").save_pretrained(tmp_path)
    AutoConfig.for_model("qwen3_vl").save_pretrained(tmp_path)
    (tmp_path / "chat_template.jinja").write_text(_FOLDER)
    proc, _, skipped = build_processor(tmp_path)
    assert skipped is None, skipped
    # the folder's tokenizer is the built-in one, saved: the encoder keeps its cached copy
    enc = Encoder("qwen3_vl", chat_template=load_template("auto", tmp_path))
    conv = parse_record({**AGENT, "messages": AGENT["messages"][1:]}, file=DataFile(tmp_path), key="k")
    ids = enc.encode(conv).input_ids.tolist()
    assert _hf_inputs(proc, conv)["input_ids"][0].tolist() == ids
    assert enc.tokenizer.decode(ids).startswith("<|im_start|>system\nTools:\n- get_weather: {")


def test_reasoning_content_goes_into_the_think_block(tmp_path):
    """Qwen3.5 writes an answer's `reasoning_content` (trimmed) into its think block after the
    last user query, and drops it before; Qwen3-VL's template writes no think block, so the
    reasoning is not in its rendering. Supervised as the answer is."""
    rec = _record([
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1", "reasoning_content": "old"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": None, "reasoning_content": " need f\n",
         "tool_calls": [_call("get_weather", {"city": "Rome"})]},
        {"role": "tool", "content": "sun"},
        {"role": "assistant", "content": "Sunny.", "reasoning_content": "it said sun"}],
        tools=[WEATHER])  # fmt: skip
    conv = parse_record(rec, file=DataFile(tmp_path), key="k")
    enc = Encoder("qwen3_5", supervise_empty_think=False)
    sample = enc.encode(conv)
    assert enc.tokenizer.decode(sample.input_ids).endswith(
        "<|im_start|>user\nq1<|im_end|>\n<|im_start|>assistant\na1<|im_end|>\n"
        "<|im_start|>user\nq2<|im_end|>\n<|im_start|>assistant\n<think>\nneed f\n</think>\n\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n</function>\n"
        "</tool_call><|im_end|>\n" "<|im_start|>user\n<tool_response>\nsun\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n<think>\nit said sun\n</think>\n\nSunny.<|im_end|>\n")
    assert _runs(enc, sample) == [
        "a1<|im_end|>",
        "<think>\nneed f\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n"
        "</parameter>\n</function>\n</tool_call><|im_end|>",
        "<think>\nit said sun\n</think>\n\nSunny.<|im_end|>"]
    vl = Encoder("qwen3_vl")
    assert "said" not in vl.tokenizer.decode(vl.encode(conv).input_ids)
    with pytest.raises(BadSampleError, match=r'k: turn 0: "reasoning_content" must be'):
        parse_record(_record([{**_USER, "reasoning_content": "x"}, _ANSWER]), file=DataFile(tmp_path),
                     key="k")


def test_a_user_turn_that_wraps_a_tool_response_is_not_a_query(tmp_path):
    """Qwen3.5 counts think blocks from the last user query; a user message that only holds a
    `<tool_response>` (calls and results written as text) is not one, so both answers get it."""
    rec = _record([_USER, {"role": "assistant", "content": "<tool_call>f</tool_call>"},
                   {"role": "user", "content": " <tool_response>\nr\n</tool_response>\n"},
                   {"role": "assistant", "content": "done"}])
    enc = Encoder("qwen3_5")
    text = enc.tokenizer.decode(enc.encode(parse_record(rec, file=DataFile(tmp_path), key="k")).input_ids)
    assert text == ("<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
                    "<tool_call>f</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nr\n"
                    "</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
                    "done<|im_end|>\n")
