"""The v1 contracts: `buf lint` (STANDARD) passes, and the inference messages keep the exact fields
issue #2 spells out, so a rename cannot slip through unnoticed.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf.descriptor import FieldDescriptor

from meshline.inference.v1 import inference_pb2

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("preprocess", "trainer", "converter", "inference", "evaluator")


def _buf_binary() -> str | None:
    beside_python = Path(sys.executable).parent / "buf"
    if beside_python.exists():
        return str(beside_python)
    return shutil.which("buf")


def test_buf_lint_standard_passes() -> None:
    buf = _buf_binary()
    if buf is None:
        pytest.skip("the buf binary (pip package buf-bin) is not installed in this environment")
    result = subprocess.run(
        [buf, "lint"], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, f"buf lint failed:\n{result.stdout}{result.stderr}"


def test_every_service_has_a_v1_contract() -> None:
    for name in SERVICES:
        protos = list((ROOT / "proto" / "meshline" / name / "v1").glob("*.proto"))
        assert protos, f"no proto for service {name!r} under proto/meshline/{name}/v1/"


def _fields(message: type) -> dict[str, tuple[str, bool, bool]]:
    """name -> (type name, repeated, explicit presence) for every field of a message class."""
    out = {}
    for field in message.DESCRIPTOR.fields:
        if field.message_type is not None:
            type_name = field.message_type.name
        elif field.enum_type is not None:
            type_name = field.enum_type.name
        else:
            type_name = _SCALAR_NAMES[field.type]
        repeated = field.is_repeated
        presence = field.has_presence and field.message_type is None and not repeated
        out[field.name] = (type_name, repeated, presence)
    return out


_SCALAR_NAMES = {
    FieldDescriptor.TYPE_STRING: "string",
    FieldDescriptor.TYPE_INT32: "int32",
    FieldDescriptor.TYPE_INT64: "int64",
    FieldDescriptor.TYPE_UINT64: "uint64",
    FieldDescriptor.TYPE_FLOAT: "float",
    FieldDescriptor.TYPE_DOUBLE: "double",
    FieldDescriptor.TYPE_BOOL: "bool",
}

# (type, repeated, `optional` presence) per field, as issue #2 writes them (plus issue #20's
# top-k log-probabilities and issue #39's LoRA adapter).
ISSUE_FIELDS = {
    "GenerateRequest": {
        "prompt": ("string", False, False),
        "prompt_token_ids": ("int32", True, False),
        "params": ("SamplingParams", False, False),
        "add_special_tokens": ("bool", False, True),
        "lora_adapter": ("string", False, False),
        "structured_output": ("StructuredOutput", False, False),
    },
    "SamplingParams": {
        "max_new_tokens": ("int32", False, True),
        "temperature": ("float", False, True),
        "top_k": ("int32", False, True),
        "top_p": ("float", False, True),
        "num_beams": ("int32", False, True),
        "do_sample": ("bool", False, True),
        "repetition_penalty": ("float", False, True),
        "stop": ("string", True, False),
        "seed": ("uint64", False, True),
        "length_penalty": ("float", False, True),
        "num_return_sequences": ("int32", False, True),
        "early_stopping": ("bool", False, True),
        "logprobs": ("int32", False, True),
    },
    "GenerateResponse": {"sequences": ("Sequence", True, False)},
    "Sequence": {
        "token_ids": ("int32", True, False),
        "text": ("string", False, False),
        "finish_reason": ("FinishReason", False, False),
        "cumulative_logprob": ("double", False, False),
        "seed": ("uint64", False, False),
        "token_logprobs": ("double", True, False),
        "top_logprobs": ("TopLogprobs", True, False),
    },
    "TopLogprobs": {"candidates": ("TokenLogprob", True, False)},
    "TokenLogprob": {"token_id": ("int32", False, False), "logprob": ("double", False, False)},
    "ScoreRequest": {
        "items": ("ScoreItem", True, False),
        "top_logprobs": ("int32", False, True),
    },
    "ScoreItem": {
        "context": ("string", False, False),
        "continuation": ("string", False, False),
        "context_token_ids": ("int32", True, False),
        "continuation_token_ids": ("int32", True, False),
    },
    "ScoreResponse": {"results": ("ScoreResult", True, False)},
    "ScoreResult": {
        "logprob": ("double", False, False),
        "is_greedy": ("bool", False, False),
        "token_logprobs": ("double", True, False),
        "top_logprobs": ("TopLogprobs", True, False),
    },
}


@pytest.mark.parametrize("message_name", sorted(ISSUE_FIELDS))
def test_inference_messages_match_issue(message_name: str) -> None:
    message = getattr(inference_pb2, message_name)
    assert _fields(message) == ISSUE_FIELDS[message_name]


def test_inference_rpcs_match_issue() -> None:
    service = inference_pb2.DESCRIPTOR.services_by_name["InferenceService"]
    signatures = {
        method.name: (
            method.input_type.name,
            method.output_type.name,
            method.server_streaming,
        )
        for method in service.methods
    }
    assert signatures == {
        "Generate": ("GenerateRequest", "GenerateResponse", False),
        "GenerateStream": ("GenerateRequest", "GenerateStreamResponse", True),
        "Score": ("ScoreRequest", "ScoreResponse", False),
        "Tokenize": ("TokenizeRequest", "TokenizeResponse", False),
        "Detokenize": ("DetokenizeRequest", "DetokenizeResponse", False),
        "GetModelInfo": ("GetModelInfoRequest", "GetModelInfoResponse", False),
        "UpdateWeights": ("UpdateWeightsRequest", "UpdateWeightsResponse", False),
        "GetWeightsVersion": ("GetWeightsVersionRequest", "GetWeightsVersionResponse", False),
        "LoadLoraAdapter": ("LoadLoraAdapterRequest", "LoadLoraAdapterResponse", False),
        "UnloadLoraAdapter": ("UnloadLoraAdapterRequest", "UnloadLoraAdapterResponse", False),
        "Reward": ("RewardRequest", "RewardResponse", False),
    }


def test_finish_reasons_cover_length_eos_and_stop_strings() -> None:
    names = set(inference_pb2.FinishReason.keys())
    assert {
        "FINISH_REASON_UNSPECIFIED",
        "FINISH_REASON_LENGTH",
        "FINISH_REASON_STOP",
        "FINISH_REASON_STOP_STRING",
    } <= names
    assert inference_pb2.FinishReason.Value("FINISH_REASON_UNSPECIFIED") == 0


def test_stream_response_carries_index_tokens_text_and_finish_reason() -> None:
    fields = _fields(inference_pb2.GenerateStreamResponse)
    assert fields["index"] == ("int32", False, False)
    assert fields["token_ids"] == ("int32", True, False)
    assert fields["text"] == ("string", False, False)
    assert fields["finish_reason"] == ("FinishReason", False, False)
