"""Structured output and tool calls over the OpenAI HTTP API, with the official `openai` client,
against a real localhost server (a tiny random llama with a HF fast tokenizer: its free text is
noise, so every well-formed answer here is the grammar's doing)."""

from __future__ import annotations

import json
import re
from typing import Literal

import jsonschema
import pytest
from pydantic import BaseModel, Field

from tests.services.inference.helpers import hf_reference, save_hf_checkpoint
from tests.services.inference.http_served import ServerHarness

openai = pytest.importorskip("openai")

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome", "Oslo"]},
        "population": {"type": "integer", "minimum": 0, "maximum": 999},
        "coastal": {"type": "boolean"},
    },
    "required": ["city", "population", "coastal"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Rome"]},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


class City(BaseModel):
    city: Literal["Paris", "Rome", "Oslo"]
    population: int = Field(ge=0, le=999)
    coastal: bool


@pytest.fixture(scope="module")
def served(tmp_path_factory, hf_tokenizer_dir):
    hf, _, config = hf_reference("llama-gqa", seed=4, vocab_size=512, max_position_embeddings=1024)
    directory = save_hf_checkpoint(hf, tmp_path_factory.mktemp("ckpt"))
    harness = ServerHarness(directory, hf, config, tokenizer=hf_tokenizer_dir)
    served = harness.start()
    yield served
    harness.close()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served.http_url}/v1", api_key="none", max_retries=0)


def _chat(client, served, **kwargs):
    args = {"model": served.model_name, "messages": QUESTION, "max_tokens": 96, "seed": 3}
    return client.chat.completions.create(**{**args, **kwargs})


def test_client_parse_with_a_pydantic_model(client, served):
    done = client.chat.completions.parse(
        model=served.model_name, messages=QUESTION, response_format=City, max_tokens=96, seed=1
    )
    message = done.choices[0].message
    assert isinstance(message.parsed, City)
    assert done.choices[0].finish_reason == "stop"


def test_json_schema_every_sampled_choice_validates(client, served):
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
    done = _chat(client, served, response_format=fmt, n=4, temperature=1.0)
    for choice in done.choices:
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    free = _chat(client, served, max_tokens=24, temperature=0)
    with pytest.raises(ValueError):
        json.loads(free.choices[0].message.content)  # the same model unconstrained: noise


def test_json_object_streamed(client, served):
    stream = _chat(client, served, response_format={"type": "json_object"}, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert isinstance(json.loads(text), dict)


def test_vllm_guided_fields_on_completions(client, served):
    base = {"model": served.model_name, "prompt": "Answer:", "max_tokens": 24, "seed": 2}
    regex = client.completions.create(**base, extra_body={"guided_regex": r"[0-9]{3}-[a-z]{2}"})
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", regex.choices[0].text)
    choice = client.completions.create(**base, extra_body={"guided_choice": ["yes", "no"]})
    assert choice.choices[0].text in ("yes", "no")
    outputs = client.completions.create(
        **{**base, "max_tokens": 96}, extra_body={"structured_outputs": {"json": SCHEMA}}
    )
    jsonschema.validate(json.loads(outputs.choices[0].text), SCHEMA)


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_forced_tool_choice_always_parses(client, served, choice):
    done = _chat(client, served, tools=[WEATHER, TIME], tool_choice=choice, temperature=0)
    answer = done.choices[0]
    assert answer.finish_reason == "tool_calls"
    calls = answer.message.tool_calls
    assert calls and all(c.id.startswith("call_") for c in calls)
    if isinstance(choice, dict):
        assert [c.function.name for c in calls] == ["get_weather"]
    for call in calls:
        schema = (WEATHER if call.function.name == "get_weather" else TIME)["function"]
        jsonschema.validate(json.loads(call.function.arguments), schema["parameters"])


def test_streamed_tool_call_deltas(client, served):
    named = {"type": "function", "function": {"name": "get_weather"}}
    stream = _chat(client, served, tools=[WEATHER], tool_choice=named, stream=True)
    chunks = [c for c in stream if c.choices]
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert [d.function.name for d in deltas] == ["get_weather"]
    assert json.loads(deltas[0].function.arguments)["city"] in ("Paris", "Rome")
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert all(not (c.choices[0].delta.content or "") for c in chunks)


def test_auto_and_none_leave_the_answer_free(client, served):
    # A random model does not call: the answer is content, and a tool result turn renders.
    history = [
        *QUESTION,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C, sunny"},
    ]
    for choice in ("auto", "none"):
        done = _chat(
            client, served, messages=history, tools=[WEATHER], tool_choice=choice, max_tokens=8
        )
        assert done.choices[0].message.tool_calls is None
        assert done.choices[0].finish_reason in ("stop", "length")


def test_beam_search_answers_follow_the_schema(client, served):
    """vLLM's `use_beam_search` with a schema: each beam keeps its own grammar state, so every
    returned hypothesis parses and validates."""
    schema = City.model_json_schema()
    done = _chat(
        client,
        served,
        n=2,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}},
        extra_body={"use_beam_search": True, "best_of": 3},
    )
    assert len(done.choices) == 2
    for choice in done.choices:
        jsonschema.validate(json.loads(choice.message.content), schema)


def _refused(client, served, param: str, **kwargs) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        _chat(client, served, **kwargs)
    error = caught.value.body
    assert error["type"] == "invalid_request_error" and error["param"].startswith(param), error


def test_bad_input_is_a_400_naming_the_field(client, served):
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}
    _refused(client, served, "response_format.json_schema.schema", response_format=bad_schema)
    _refused(client, served, "guided_regex", extra_body={"guided_regex": "[a-"})
    broken = {**WEATHER, "function": {**WEATHER["function"], "parameters": {"type": 3}}}
    _refused(client, served, "tools[0].function.parameters", tools=[broken])
    many = [{**TIME, "function": {**TIME["function"], "name": f"f{i}"}} for i in range(129)]
    _refused(client, served, "tools", tools=many)
    unknown = {"type": "function", "function": {"name": "nope"}}
    _refused(client, served, "tool_choice", tools=[WEATHER], tool_choice=unknown)
    _refused(client, served, "tool_choice", tool_choice="required")
    _refused(
        client,
        served,
        "guided_choice",
        response_format={"type": "json_object"},
        extra_body={"guided_choice": ["a"]},
    )
    # The server goes on serving.
    assert _chat(client, served, max_tokens=4).choices[0].message.content is not None


# ---- the same constraints over gRPC (GenerateRequest.structured_output) ----------------------


def test_grpc_structured_output_follows_its_constraint(served):
    """`meshline_client` over gRPC: a JSON schema (sampled, n = 3; each validates), any JSON
    object, a regex and a choice; streaming gives the same greedy text as Generate."""
    from meshline_client.connection import Connection
    from meshline_client.inference import InferenceClient

    client = InferenceClient(Connection(f"127.0.0.1:{served.grpc_port}", timeout_s=120))
    try:
        prompt = "Describe a city:"
        sampled = client.generate_all(
            prompt,
            structured_output={"json_schema": SCHEMA},
            do_sample=True,
            seed=5,
            num_return_sequences=3,
            max_new_tokens=96,
        )
        for completion in sampled:
            assert completion.finish_reason == "stop"
            jsonschema.validate(json.loads(completion.text), SCHEMA)
        anything = client.generate(prompt, structured_output={"json_object": True},
                                   max_new_tokens=24)  # fmt: skip
        assert anything.text.startswith("{")  # a random model may not close it within 24 tokens
        if anything.finish_reason == "stop":
            assert isinstance(json.loads(anything.text), dict)
        pattern = r"[0-9]{3}-[a-z]{2}"
        text = client.generate(prompt, structured_output={"regex": pattern}, max_new_tokens=16)
        assert re.fullmatch(pattern, text.text)
        choices = ["yes", "no", "maybe"]
        greedy = client.generate(prompt, structured_output={"choice": choices}, max_new_tokens=8)
        assert greedy.text in choices
        streamed = client.stream(prompt, structured_output={"choice": choices}, max_new_tokens=8)
        assert "".join(d.text for d in streamed) == greedy.text
    finally:
        client.close()


def test_grpc_structured_output_errors_name_the_field(served):
    import grpc

    from meshline.inference.v1 import inference_pb2 as pb

    def refused(constraint: pb.StructuredOutput, field: str) -> None:
        request = pb.GenerateRequest(
            prompt="x", params=pb.SamplingParams(max_new_tokens=4), structured_output=constraint
        )
        with pytest.raises(grpc.RpcError) as caught:
            served.grpc_stub.Generate(request, timeout=60)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in caught.value.details(), caught.value.details()

    refused(pb.StructuredOutput(), "structured_output")
    refused(pb.StructuredOutput(json_schema='{"type": "foo"}'), "structured_output.json_schema")
    refused(pb.StructuredOutput(json_schema="not json"), "structured_output.json_schema")
    refused(pb.StructuredOutput(regex="[a-"), "structured_output.regex")
    refused(pb.StructuredOutput(regex="a" * 5000), "structured_output.regex")
    refused(pb.StructuredOutput(json_object=False), "structured_output.json_object")
    refused(pb.StructuredOutput(choice=pb.Choices(values=[str(i) for i in range(257)])),
            "structured_output.choice")  # fmt: skip
    request = pb.GenerateRequest(prompt="x", params=pb.SamplingParams(max_new_tokens=4))
    assert served.grpc_stub.Generate(request, timeout=60).sequences  # it goes on serving


class Note(BaseModel):
    title: str
    body: str
    tags: list[str]


def test_unbounded_strings_under_a_tight_max_tokens_still_parse(client, served):
    """A random model writes an unbounded string until it is stopped: with a few tokens to
    spare the server closes it in time, so `parse` gets a valid object (finish "stop") at every
    budget, and a budget below the shortest answer is a 400 naming max_tokens."""
    schema = Note.model_json_schema()
    for max_tokens in (30, 34, 44):  # the shortest answer takes 29 tokens here
        done = client.chat.completions.parse(
            model=served.model_name,
            messages=QUESTION,
            response_format=Note,
            max_tokens=max_tokens,
            temperature=1.0,
            seed=max_tokens,
        )
        assert done.choices[0].finish_reason == "stop"
        assert isinstance(done.choices[0].message.parsed, Note)
        assert done.usage.completion_tokens <= max_tokens
        jsonschema.validate(json.loads(done.choices[0].message.content), schema)
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.parse(
            model=served.model_name, messages=QUESTION, response_format=Note, max_tokens=28
        )
    assert refused.value.body["param"] == "max_tokens"
    assert "takes 29 tokens" in refused.value.body["message"]
