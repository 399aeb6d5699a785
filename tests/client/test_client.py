"""meshline_client against a real inference server, gRPC's retry policy, and the lm-eval model."""

from __future__ import annotations

import json
from concurrent import futures

import grpc
import pytest
import torch

from meshline.inference.v1 import inference_pb2 as pb
from meshline.inference.v1 import inference_pb2_grpc as pb_grpc
from meshline_client import Connection, InferenceClient
from tests.services.inference.helpers import EOS_ID, hf_generate
from tests.services.inference.http_served import ServerHarness, make_checkpoint


@pytest.fixture(scope="module")
def served(tmp_path_factory, sentencepiece_model):
    directory, hf, config = make_checkpoint(tmp_path_factory, sentencepiece_model, seed=6)
    harness = ServerHarness(directory, hf, config)
    yield harness.start()
    harness.close()


@pytest.fixture(scope="module")
def client(served):
    with InferenceClient(Connection(f"127.0.0.1:{served.grpc_port}", timeout_s=60)) as client:
        yield client


def _greedy(served, ids: list[int], n: int) -> list[int]:
    out = hf_generate(served.hf, ids, max_new_tokens=n)[0, len(ids) :].tolist()
    return out[: out.index(EOS_ID) + 1] if EOS_ID in out else out


def test_generate_stream_tokenize_match_hf(client, served):
    ids = client.tokenize("the cat sat", add_special_tokens=True)
    assert ids == served.engine.tokens.encode_prompt("the cat sat")
    expected = _greedy(served, ids, 8)
    completion = client.generate("the cat sat", max_new_tokens=8, logprobs=2)
    assert completion.token_ids == expected
    assert completion.text == client.detokenize(expected)
    assert [top[0].token_id for top in completion.top_logprobs] == expected
    deltas = list(client.stream(ids, max_new_tokens=8))
    assert [t for d in deltas for t in d.token_ids] == expected
    assert deltas[-1].finish_reason in ("length", "stop")
    info = client.model_info()
    assert info.vocab_size == 512 and info.eos_token_id == EOS_ID


def test_score_matches_hf_and_is_greedy(client, served):
    context = [1, 30, 31, 32]
    greedy = _greedy(served, context, 2)
    with torch.no_grad():
        row = torch.log_softmax(served.hf(torch.tensor([context])).logits[0, -1].float(), -1)
    worst = int(row.argmin())
    a, b = client.score([(context, greedy), (context, [worst])], top_logprobs=1)
    assert a.is_greedy and not b.is_greedy
    assert b.logprob == pytest.approx(float(row[worst]), abs=1e-4)
    assert b.top_logprobs[0][0].token_id == int(row.argmax())


def test_deadline_is_enforced(client):
    with pytest.raises(grpc.RpcError) as raised:
        client.generate([1, 5, 6], max_new_tokens=120, timeout_s=0.001)
    assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


class _Flaky(pb_grpc.InferenceServiceServicer):
    """Answers UNAVAILABLE to the first `failures` Tokenize calls."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls = 0

    def Tokenize(self, request, context):
        self.calls += 1
        if self.calls <= self.failures:
            context.abort(grpc.StatusCode.UNAVAILABLE, "warming up")
        return pb.TokenizeResponse(token_ids=[7, 8])


@pytest.mark.parametrize(("attempts", "succeeds"), [(4, True), (2, False)])
def test_unavailable_is_retried_by_the_grpc_retry_policy(attempts, succeeds):
    flaky = _Flaky(failures=2)
    server = grpc.server(futures.ThreadPoolExecutor(2))
    pb_grpc.add_InferenceServiceServicer_to_server(flaky, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        connection = Connection(f"127.0.0.1:{port}", max_attempts=attempts, initial_backoff_s=0.01)
        config = json.loads(connection.service_config())
        assert config["methodConfig"][0]["retryPolicy"]["retryableStatusCodes"] == ["UNAVAILABLE"]
        with InferenceClient(connection) as client:
            if succeeds:
                assert client.tokenize("x") == [7, 8]
                assert flaky.calls == 3
            else:
                with pytest.raises(grpc.RpcError) as raised:
                    client.tokenize("x")
                assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
                assert flaky.calls == 2
    finally:
        server.stop(0)


def test_lm_eval_meshline_model(served):
    from lm_eval.api.instance import Instance
    from lm_eval.api.registry import get_model

    import meshline_client.lm_eval_model  # noqa: F401  (registers "meshline")

    lm = get_model("meshline").create_from_arg_string(
        f"endpoint=127.0.0.1:{served.grpc_port},batch_size=4"
    )
    tokens = served.engine.tokens
    for context in ("one two three", "the cat sat on", "a b c d", "hello there", "we go"):
        ids = tokens.require().encode(context)
        with torch.no_grad():
            row = torch.log_softmax(served.hf(torch.tensor([ids])).logits[0, -1].float(), -1)
        top = int(row.argmax())
        continuation = tokens.decode([*ids, top])[len(tokens.decode(ids)) :]
        if continuation and tokens.require().encode(context + continuation) == [*ids, top]:
            break
    else:
        pytest.fail("no fixture context whose greedy token survives lm-eval's tokenization")
    [(logprob, greedy)] = lm.loglikelihood(
        [Instance("loglikelihood", {}, (context, continuation), 0)]
    )
    assert greedy is True and logprob == pytest.approx(float(row[top]), abs=1e-4)
    [text] = lm.generate_until(
        [Instance("generate_until", {}, (context, {"until": ["zzz"], "max_gen_toks": 6}), 0)]
    )
    prompt = served.engine.tokens.encode_prompt(context)
    assert text == tokens.decode(_greedy(served, prompt, 6))
    [rolling] = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (context,), 0)])
    full = [tokens.bos_id, *ids]
    with torch.no_grad():
        rows = torch.log_softmax(served.hf(torch.tensor([full])).logits[0].float(), -1)
    expected = sum(float(rows[t, full[t + 1]]) for t in range(len(full) - 1))
    assert rolling == pytest.approx(expected, abs=1e-4)


def test_lm_eval_meshline_model_add_bos_token(served):
    """add_bos_token=True encodes as the served tokenizer defines (BOS first for this Llama-style
    sentencepiece tokenizer), as lm-eval's add_bos_token does; the default encodes without it."""
    from lm_eval.api.registry import get_model

    import meshline_client.lm_eval_model  # noqa: F401  (registers "meshline")

    endpoint = f"endpoint=127.0.0.1:{served.grpc_port}"
    plain = get_model("meshline").create_from_arg_string(endpoint)
    with_bos = get_model("meshline").create_from_arg_string(f"{endpoint},add_bos_token=True")
    ids = served.engine.tokens.require().encode("the cat sat on")
    assert plain.tok_encode("the cat sat on") == ids
    assert with_bos.tok_encode("the cat sat on") == [served.engine.tokens.bos_id, *ids]
    with pytest.raises(ValueError, match="add_bos_token='maybe'"):
        get_model("meshline").create_from_arg_string(f"{endpoint},add_bos_token=maybe")
