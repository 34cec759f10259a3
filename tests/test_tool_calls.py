"""Tool calling on `/v1/chat/completions`, proven with the official `openai` client against a real
`pagefleet serve` (the built-in random model): forced calls (`tool_choice="required"` and a
named function) return arguments valid under the function's schema, whole and streamed as
OpenAI streams `tool_calls` deltas; `auto` reads the `<tool_call>` blocks a model writes; a tool
loop sends the assistant's calls and the tool's answer back; bad tools and tool choices are 400s
naming the field. Below the door: the parser on strings (a stream cut anywhere reads as the
whole), the chat template's rendering of tools (a template that renders them, and the system
prompt for one that does not), and a resumed tool-call stream that goes on as the undisturbed
one."""

from __future__ import annotations

import copy
import json
import random

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from transformers import AutoTokenizer

from pagefleet.llm import engine_config
from tests.redis_server import free_port
from tests.serve_process import builtin_model_flags, start_serve
from worker.chat import render_chat, render_chat_text
from worker.engine.llm_engine import LLMEngine
from worker.model.builtin_model import builtin_model_path
from worker.protocol import Resume
from worker.sampling_params import SamplingParams
from worker.tool_parser import ToolCall, ToolCallParser, parse_tool_calls
from worker.tools import check_tools, tool_call_constraint

ENGINE = dict(max_model_len=2048, num_blocks=512)
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
}
SEARCH = {"type": "object", "properties": {"q": {"type": "string", "maxLength": 6}}, "required": ["q"]}
TOOLS = [
    {"type": "function", "function": {"name": "weather", "description": "A forecast", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "search", "description": "Web search", "parameters": SEARCH}},
]
SCHEMAS = {"weather": WEATHER, "search": SEARCH}
ASK = [{"role": "user", "content": "Will it rain in Paris?"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(openai client, model name)."""
    tmp = tmp_path_factory.mktemp("tools")
    http_port = free_port()
    flags = [*builtin_model_flags(), f"--http-port={http_port}", "--grace=1", "--no-metrics"]
    flags += [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE.items()]
    proc, client = start_serve(flags, free_port(), tmp / "serve.log", 240)
    api = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="x", max_retries=0, timeout=120)
    try:
        yield api, client.model_info().model
    finally:
        client.close()
        proc.terminate()
        proc.wait(60)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(builtin_model_path()))


def streamed(chunks) -> tuple[str, list[dict], str, list[dict]]:
    """(content, calls, finish reason, the tool_calls deltas) of a streamed chat completion."""
    content, calls, finish, deltas = "", [], None, []
    for chunk in chunks:
        (choice,) = chunk.choices
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or ():
            deltas.append(d.model_dump(exclude_none=True))
            if d.id is not None:
                assert d.index == len(calls) and d.type == "function" and d.function.name
                calls.append({"id": d.id, "name": d.function.name, "arguments": ""})
            calls[d.index]["arguments"] += d.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, calls, finish, deltas


# ---- forced calls ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "search"}}], ids=["required", "named"]
)
def test_a_forced_call_is_valid_under_its_schema_whole_and_streamed(served, choice):
    api, model = served
    kw = dict(model=model, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=120, parallel_tool_calls=False)
    kw |= dict(temperature=1.0, seed=1)  # the same seed: the stream's tokens are the whole's
    whole = api.chat.completions.create(**kw)
    (c,) = whole.choices
    assert c.finish_reason == "tool_calls" and c.message.content is None
    (call,) = c.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    if isinstance(choice, dict):
        assert call.function.name == choice["function"]["name"]
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    content, calls, finish, deltas = streamed(api.chat.completions.create(**kw, stream=True))
    assert (content, finish) == ("", "tool_calls")
    assert [(x["name"], x["arguments"]) for x in calls] == [(call.function.name, call.function.arguments)]
    assert len(deltas) > 2 and all(set(d) == {"index", "function"} for d in deltas[1:])  # arguments in pieces


def test_parallel_calls_are_each_a_call_of_a_tool(served):
    api, model = served
    done = api.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=120, temperature=1.0, seed=5
    )
    (c,) = done.choices
    calls = c.message.tool_calls
    assert calls and c.finish_reason in ("tool_calls", "length")
    complete = calls if c.finish_reason == "tool_calls" else calls[:-1]  # (the last may be cut)
    for call in complete:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert len({call.id for call in calls}) == len(calls)


class Forecast(BaseModel):
    city: str = Field(json_schema_extra={"enum": ["Paris", "Rome"]})
    days: int = Field(ge=1, le=3)


def test_parse_reads_the_arguments_into_the_pydantic_model(served):
    api, model = served
    done = api.chat.completions.parse(
        model=model,
        messages=ASK,
        tools=[openai.pydantic_function_tool(Forecast)],
        tool_choice="required",
        max_tokens=120,
        temperature=1.0,
        seed=2,
    )
    (call,) = done.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, Forecast)
    assert call.function.parsed_arguments.city in ("Paris", "Rome")


# ---- auto: calls read from what the model writes ------------------------------------------------

WRITTEN = 'Let me look.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Rome", "days": 2}}\n</tool_call>'


def test_auto_reads_the_tool_call_blocks_the_model_writes(served):
    """A constraint makes the model write a Hermes call after some text; `auto` reads it, whole
    and streamed; text that only names the tag stays content."""
    api, model = served
    kw = dict(model=model, messages=ASK, tools=TOOLS, max_tokens=120)
    written = {"structured_outputs": {"choice": [WRITTEN]}}
    (c,) = api.chat.completions.create(**kw, extra_body=written).choices
    calls = [{"name": t.function.name, "arguments": t.function.arguments} for t in c.message.tool_calls]
    assert (c.message.content, c.finish_reason) == ("Let me look.", "tool_calls")
    assert [(x["name"], json.loads(x["arguments"])) for x in calls] == [("weather", {"city": "Rome", "days": 2})]
    content, streamed_calls, finish, _ = streamed(api.chat.completions.create(**kw, extra_body=written, stream=True))
    assert (content, finish) == ("Let me look.", "tool_calls")
    assert [(x["name"], x["arguments"]) for x in streamed_calls] == [(x["name"], x["arguments"]) for x in calls]
    plain = api.chat.completions.create(**kw, extra_body={"structured_outputs": {"choice": ["<tool_call> is a tag."]}})
    (c,) = plain.choices
    assert (c.message.content, c.message.tool_calls, c.finish_reason) == ("<tool_call> is a tag.", None, "stop")


def test_a_tool_loop_sends_the_call_and_the_answer_back(served, tokenizer):
    api, model = served
    first = api.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=120, parallel_tool_calls=False
    )
    message = first.choices[0].message
    (call,) = message.tool_calls
    answer = {"role": "tool", "tool_call_id": call.id, "content": '{"rain": false}'}
    messages = [*ASK, message, answer]
    second = api.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=4)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    sent = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]}, answer]
    ids = render_chat(tokenizer, sent, tools=check_tools(TOOLS))
    assert second.usage.prompt_tokens == len(ids)
    text = render_chat_text(tokenizer, sent, check_tools(TOOLS))
    assert '<tool_response>\n{"rain": false}\n</tool_response>' in text and call.function.arguments in text


# ---- refusals -------------------------------------------------------------------------------------

CALLED = {
    "role": "assistant",
    "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
}
CASES = {
    "type": (dict(tools=[{"type": "code", "function": {"name": "f"}}]), "tools[0].type"),
    "name": (dict(tools=[{"type": "function", "function": {"name": "no spaces"}}]), "tools[0].function.name"),
    "no name": (dict(tools=[{"type": "function", "function": {"description": "x"}}]), "tools[0].function.name"),
    "twice": (dict(tools=[TOOLS[0], TOOLS[0]]), "tools[1].function.name"),
    "array": (
        dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]),
        "tools[0].function.parameters",
    ),
    "choice": (dict(tools=TOOLS, tool_choice="sometimes"), "tool_choice"),
    "unknown": (
        dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
        "tool_choice.function.name",
    ),
    "no tools": (dict(tool_choice="required"), "tool_choice"),
    "parallel": (dict(parallel_tool_calls=True), "parallel_tool_calls"),
    "and format": (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "tool_choice"),
    "bad schema": (
        dict(
            tools=[
                {
                    "type": "function",
                    "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "nope"}}}},
                }
            ],
            tool_choice="required",
        ),
        "tools",
    ),
    "too large": (
        dict(
            tools=[
                {
                    "type": "function",
                    "function": {"name": f"f{i}", "parameters": {"type": "object", "title": "t" * 999}},
                }
                for i in range(80)
            ],
            tool_choice="required",
        ),
        "tools",
    ),
    "no id": (dict(messages=[*ASK, CALLED, {"role": "tool", "content": "1"}]), "messages[2].tool_call_id"),
    "wrong id": (
        dict(messages=[*ASK, CALLED, {"role": "tool", "content": "1", "tool_call_id": "c2"}]),
        "messages[2].tool_call_id",
    ),
    "no content": (dict(messages=[*ASK, {"role": "assistant"}]), "messages[1].content"),
    "calls of a user": (dict(messages=[{**CALLED, "role": "user"}]), "messages[0].tool_calls"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_tools_and_tool_choices_are_400_naming_the_field(served, case):
    api, model = served
    fields, param = CASES[case]
    kw = dict(model=model, messages=ASK, max_tokens=4) | fields
    with pytest.raises(openai.BadRequestError) as e:
        api.chat.completions.create(**kw)
    assert e.value.body["param"] == param, e.value.body
    assert "Traceback" not in e.value.body["message"]


# ---- the parser on strings ----------------------------------------------------------------------

PARSED = {
    "text": ("No call here.  ", "No call here.  ", []),
    "hermes": (
        '<tool_call>\n{"name": "f", "arguments": {"a": "}{\\"", "b": [1, {"c": 2}]}}\n</tool_call>',
        "",
        [ToolCall("f", '{"a": "}{\\"", "b": [1, {"c": 2}]}')],
    ),
    "two and text": (
        'Sure.\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n<tool_call>{"name":"g","arguments":{"x":1}}</tool_call>',
        "Sure.",
        [ToolCall("f", "{}"), ToolCall("g", '{"x":1}')],
    ),
    "smollm2 list": (
        '<tool_call>[{"name": "f", "arguments": {"q": "x"}}, {"name": "g", "arguments": "{\\"y\\": 2}"}]</tool_call>',
        "",
        [ToolCall("f", '{"q": "x"}'), ToolCall("g", '{"y": 2}')],
    ),
    "arguments first": ('<tool_call>{"arguments": {"q": 1}, "name": "f"}</tool_call>', "", [ToolCall("f", '{"q": 1}')]),
    "not calls": ("a <tool_call>not json</tool_call> b", "a <tool_call>not json</tool_call> b", []),
    "a tag begun": ("x <tool_ca", "x <tool_ca", []),
    "cut short": ('<tool_call>\n{"name": "f", "arguments": {"q": "unfinish', "", [ToolCall("f", '{"q": "unfinish')]),
}


@pytest.mark.parametrize("case", sorted(PARSED))
def test_the_parser_reads_content_and_calls(case):
    text, content, calls = PARSED[case]
    assert parse_tool_calls(text) == (content, calls)


@pytest.mark.parametrize("case", sorted(PARSED))
def test_a_stream_cut_anywhere_reads_as_the_whole(case):
    text = PARSED[case][0]
    rng = random.Random(case)
    cuts = [[i] for i in range(1, len(text))] + [sorted(rng.sample(range(1, len(text)), 5)) for _ in range(20)]
    cuts.append(list(range(1, len(text))))  # a character at a time
    for points in cuts:
        pieces = [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]
        parser = ToolCallParser()
        parts = [parser.feed(p) for p in pieces] + [parser.finish()]
        calls: list[ToolCall] = []
        for d in (d for p in parts for d in p.calls):
            if d.name is not None:
                calls.append(ToolCall(d.name, ""))
            calls[d.index].arguments += d.arguments
        assert ("".join(p.content for p in parts), calls) == parse_tool_calls(text), points


# ---- the chat template --------------------------------------------------------------------------

# A template that renders tools, calls and tool messages, as Qwen's and Llama 3's do.
TOOL_TEMPLATE = (
    "{% if tools %}<s>system\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}</s>\n{% endif %}"
    "{% for m in messages %}<s>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}[{{ c.function.name }} {{ c.function.arguments | tojson }}]{% endfor %}"
    "</s>\n{% endfor %}{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


def test_a_template_that_renders_tools_is_given_them(tokenizer):
    theirs = copy.deepcopy(tokenizer)
    theirs.chat_template = TOOL_TEMPLATE
    sent = [*ASK, {**CALLED, "content": None}, {"role": "tool", "content": "1", "tool_call_id": "c1"}]
    text = render_chat_text(theirs, sent, check_tools(TOOLS))
    expected = [
        *ASK,
        {
            **CALLED,
            "content": "",
            "tool_calls": [{**CALLED["tool_calls"][0], "function": {"name": "f", "arguments": {}}}],
        },
        sent[2],
    ]
    assert text == theirs.apply_chat_template(expected, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert '"name": "weather"' in text and "[f {}]" in text


def test_a_template_without_tools_gets_them_in_the_system_prompt(tokenizer):
    sent = [
        {"role": "system", "content": "Be brief."},
        *ASK,
        CALLED,
        {"role": "tool", "content": "1", "tool_call_id": "c1"},
    ]
    text = render_chat_text(tokenizer, sent, check_tools(TOOLS))
    assert text.startswith("<s>system\nBe brief.\n\n# Tools\n") and json.dumps(TOOLS[1]) in text
    assert '<s>assistant\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call></s>' in text
    assert "<s>user\n<tool_response>\n1\n</tool_response></s>" in text
    assert render_chat_text(tokenizer, ASK) == tokenizer.apply_chat_template(
        ASK, add_generation_prompt=True, tokenize=False
    )


# ---- a resumed tool-call stream ----------------------------------------------------------------


@pytest.fixture(scope="module")
def engines():
    config = engine_config("builtin", num_blocks=128, max_model_len=512)
    return LLMEngine(config), LLMEngine(config)  # the group that dies, the one that resumes


def run(engine: LLMEngine, params: SamplingParams, resume: Resume | None = None) -> list:
    rid = engine.add_request("Will it rain in Paris?", params, resume=resume)
    outputs = []
    while engine.has_unfinished():
        outputs += [o for o in engine.step() if o.request_id == rid]
    return outputs


def test_a_resumed_tool_call_stream_goes_on_as_the_undisturbed_one(engines):
    """Seeded sampling under a forced call's constraint, cut in the call's head and in its
    arguments: the resumed group rebuilds the matcher from the tokens sent and goes on alike."""
    first, second = engines
    constraint = tool_call_constraint(check_tools(TOOLS), parallel=False)
    params = SamplingParams(max_tokens=120, structured_outputs=constraint, temperature=1.0, seed=11)
    whole = run(first, params)
    done = whole[-1]
    _, (call,) = parse_tool_calls(done.text)
    jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    for cut in (3, len(whole) - 4):
        before = whole[:cut]
        sent = [t for o in before for t in o.new_token_ids]
        after = run(second, params, Resume(tuple(sent), len("".join(o.new_text for o in before))))
        assert sent + [t for o in after for t in o.new_token_ids] == done.token_ids
        assert "".join(o.new_text for o in before + after) == done.text
