"""Structured outputs through both doors of a real `pagefleet serve` (the built-in model): the
official `openai` client's `chat.completions.parse` with a Pydantic model, `json_object` mode and
vLLM's `structured_outputs` in `extra_body`; gRPC's `sampling.structured_output`; the same tokens
through HTTP, gRPC and `pagefleet.LLM`; and bad schemas, regexes and grammars refused with 400 /
INVALID_ARGUMENT naming the field and carrying the grammar engine's message."""

from __future__ import annotations

import json
import re

import grpc
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from pagefleet import LLM, SamplingParams
from protos.pagefleet.v1 import pagefleet_pb2 as pb
from tests.redis_server import free_port
from tests.serve_process import builtin_model_flags, start_serve

ENGINE = dict(max_model_len=512, num_blocks=256)
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
}


class Book(BaseModel):
    title: str = Field(max_length=10)
    year: int = Field(ge=1800, le=2030)
    kind: str = Field(json_schema_extra={"enum": ["novel", "poem", "essay"]})


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(gRPC client, openai client, model name)."""
    tmp = tmp_path_factory.mktemp("structured")
    http_port = free_port()
    flags = [*builtin_model_flags(), f"--http-port={http_port}", "--grace=1"]
    flags += [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE.items()]
    proc, client = start_serve(flags, free_port(), tmp / "serve.log", 240)
    api = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="x", max_retries=0, timeout=60)
    try:
        yield client, api, client.model_info().model
    finally:
        client.close()
        proc.terminate()
        proc.wait(60)


def chat(model: str, text: str = "Name a book.") -> dict:
    return dict(model=model, messages=[{"role": "user", "content": text}], max_tokens=96)


def test_parse_returns_the_pydantic_object(served):
    _, api, model = served
    for seed in (0, 1):
        done = api.chat.completions.parse(**chat(model), response_format=Book, temperature=1.0, seed=seed)
        (choice,) = done.choices
        assert choice.finish_reason == "stop"
        book = choice.message.parsed
        assert isinstance(book, Book) and book.kind in ("novel", "poem", "essay")
        assert json.loads(choice.message.content) == book.model_dump()


def test_json_object_and_json_schema_response_formats(served):
    _, api, model = served
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    whole = api.chat.completions.create(**chat(model), response_format=fmt, temperature=0)
    text = whole.choices[0].message.content
    jsonschema.validate(json.loads(text), PERSON)
    chunks = api.chat.completions.create(**chat(model), response_format=fmt, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    obj = api.chat.completions.create(
        **chat(model) | {"max_tokens": 200}, response_format={"type": "json_object"}, temperature=0
    )
    content = obj.choices[0].message.content
    assert content.startswith("{")
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)


def test_vllms_structured_outputs_in_extra_body(served):
    _, api, model = served
    kw = dict(model=model, prompt="The river runs", max_tokens=40, temperature=1.0, seed=3)
    regex = r"\d{3}-[a-z]{2,4}"
    done = api.completions.create(**kw, extra_body={"structured_outputs": {"regex": regex}})
    assert re.fullmatch(regex, done.choices[0].text)
    choices = ["north", "south", "east or west"]
    done = api.completions.create(**kw, n=4, extra_body={"structured_outputs": {"choice": choices}})
    assert {c.text for c in done.choices} <= set(choices)
    grammar = 'root ::= "go " ("left" | "right") "!"'
    done = api.chat.completions.create(**chat(model), extra_body={"structured_outputs": {"grammar": grammar}})
    assert done.choices[0].message.content in ("go left!", "go right!")


def test_the_same_tokens_through_both_doors_and_llm(served):
    client, api, model = served
    prompt, params = "A map shows roads", dict(max_tokens=48, temperature=1.0, seed=9)
    http = api.completions.create(
        model=model,
        prompt=prompt,
        **params,
        extra_body={"structured_outputs": {"json": PERSON}, "return_token_ids": True},
    )
    request = pb.GenerateRequest(
        text=prompt,
        sampling=pb.SamplingParams(**params, structured_output=pb.StructuredOutput(json=json.dumps(PERSON))),
    )
    via_grpc = [t for r in client.stub.Generate(request, timeout=60) for t in r.token_ids]
    llm = LLM("builtin", **ENGINE)
    here = llm.generate(prompt, SamplingParams(**params, structured_outputs={"json": PERSON}))[0].outputs[0]
    assert http.choices[0].token_ids == via_grpc == list(here.token_ids)
    jsonschema.validate(json.loads(here.text), PERSON)


@pytest.mark.parametrize(
    ("extra", "param", "message"),
    [
        ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex", "parenthesis is not closed"),
        ({"structured_outputs": {"grammar": "root ::= x"}}, "structured_outputs.grammar", 'Rule "x" is not defined'),
        ({"structured_outputs": {"json": "{bad"}}, "structured_outputs.json", "is not valid JSON"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one of"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
            "response_format.json_schema.schema",
            'Unsupported type "nope"',
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema.schema", "is required"),
    ],
)
def test_bad_constraints_are_400_naming_the_field(served, extra, param, message):
    _, api, model = served
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            api.chat.completions.create(**chat(model), extra_body=extra, stream=stream)
        error = e.value.body
        assert error["param"] == param and message in error["message"], error
        assert "/project/" not in error["message"]


def test_grpc_refuses_bad_constraints_naming_the_field(served):
    client, _, _ = served
    cases = [
        (pb.StructuredOutput(regex="a(b"), "sampling.structured_output.regex is refused: .*parenthesis"),
        (pb.StructuredOutput(json='{"type": "nope"}'), "sampling.structured_output.json is refused: Unsupported type"),
        (pb.StructuredOutput(json="[1]"), "sampling.structured_output.json must be a JSON Schema object"),
        (pb.StructuredOutput(choice=pb.Choices()), "sampling.structured_output.choice must be a non-empty list"),
        (pb.StructuredOutput(), "sampling.structured_output is set but none of its fields is"),
    ]
    for constraint, message in cases:
        request = pb.GenerateRequest(
            text="Hello", sampling=pb.SamplingParams(max_tokens=4, structured_output=constraint)
        )
        with pytest.raises(grpc.RpcError) as e:
            list(client.stub.Generate(request, timeout=60))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert re.search(message, e.value.details()), e.value.details()
    choice = pb.StructuredOutput(choice=pb.Choices(choices=["up", "down"]))
    request = pb.GenerateRequest(text="Hello", sampling=pb.SamplingParams(max_tokens=4, structured_output=choice))
    assert "".join(r.text for r in client.stub.Generate(request, timeout=60)) in ("up", "down")


@pytest.mark.parametrize("options", [dict(temperature=0.0), dict(temperature=1.0, seed=21)])
def test_a_resumed_constrained_stream_goes_on_as_the_undisturbed_one(served, options):
    """GenerateRequest.resume of a constrained stream: the group rebuilds the matcher from the
    tokens already sent, and the rest equals the undisturbed run's."""
    client, _, _ = served
    constraint = pb.StructuredOutput(json=json.dumps(PERSON))

    def request() -> pb.GenerateRequest:
        sampling = pb.SamplingParams(max_tokens=64, structured_output=constraint, **options)
        return pb.GenerateRequest(text="The baker starts work", sampling=sampling)

    chunks = list(client.stub.Generate(request(), timeout=60))
    assert len(chunks) > 6
    cut = 5
    resumed = request()
    for c in chunks[:cut]:
        resumed.resume.token_ids.extend(c.token_ids)
        resumed.resume.text_chars += len(c.text)
    rest = list(client.stub.Generate(resumed, timeout=60))
    assert [t for c in rest for t in c.token_ids] == [t for c in chunks[cut:] for t in c.token_ids]
    assert "".join(c.text for c in rest) == "".join(c.text for c in chunks[cut:])
    jsonschema.validate(json.loads("".join(c.text for c in chunks)), PERSON)
