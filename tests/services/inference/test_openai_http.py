"""The official `openai` client and lm-eval's `local-completions` against the HTTP front.

Greedy text must equal HF `generate`, log-likelihoods HF's log-softmax within 1e-4, and
`is_greedy` must be right both ways.
"""

from __future__ import annotations

import pytest
import requests
import torch

from tests.services.inference.helpers import EOS_ID, hf_generate
from tests.services.inference.http_served import ServerHarness, make_checkpoint

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def served(tmp_path_factory, sentencepiece_model):
    directory, hf, config = make_checkpoint(tmp_path_factory, sentencepiece_model)
    harness = ServerHarness(directory, hf, config)
    yield harness.start()
    harness.close()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served.http_url}/v1", api_key="unused", max_retries=0)


def _hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """log-softmax rows [S, V] of HF on `ids` (row t predicts token t + 1)."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)


def _encode(served, text: str) -> list[int]:
    return served.engine.tokens.encode_prompt(text)


def test_models_lists_the_served_model(client, served):
    [model] = client.models.list().data
    assert model.id == served.model_name


def test_completion_greedy_equals_hf_generate(client, served):
    prompt = "The model reads"
    ids = _encode(served, prompt)
    out = client.completions.create(
        model=served.model_name, prompt=prompt, max_tokens=10, temperature=0
    )
    expected = hf_generate(served.hf, ids, max_new_tokens=10)[0, len(ids) :].tolist()
    expected = expected[: expected.index(EOS_ID) + 1] if EOS_ID in expected else expected
    [choice] = out.choices
    assert choice.text == served.engine.tokens.decode(expected)
    assert out.usage.prompt_tokens == len(ids)
    assert out.usage.completion_tokens == len(expected)


def test_echo_logprobs_equal_hf_with_real_top_alternatives(client, served):
    batch = [_encode(served, "one two three four"), _encode(served, "the cat sat")]
    out = client.completions.create(
        model=served.model_name, prompt=batch, max_tokens=0, echo=True, logprobs=3, temperature=0
    )
    assert len(out.choices) == 2
    for ids, choice in zip(batch, sorted(out.choices, key=lambda c: c.index), strict=True):
        reference = _hf_logprobs(served.hf, ids)
        lp = choice.logprobs
        assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(ids)
        for t in range(1, len(ids)):
            assert lp.token_logprobs[t] == pytest.approx(float(reference[t - 1, ids[t]]), abs=1e-4)
            top_values, top_ids = reference[t - 1].topk(3)
            got = lp.top_logprobs[t]
            assert len(got) == 3
            assert sorted(got.values(), reverse=True) == pytest.approx(
                top_values.tolist(), abs=1e-4
            )
            pieces = served.engine.tokens.pieces(top_ids.tolist())
            assert set(got) == set(pieces)
        assert choice.text == served.engine.tokens.decode(ids)


def test_stream_equals_non_stream_and_reports_usage(client, served):
    args = dict(model=served.model_name, prompt="a b c", max_tokens=8, temperature=0.8, seed=5)
    whole = client.completions.create(**args)
    chunks = list(
        client.completions.create(**args, stream=True, stream_options={"include_usage": True})
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    finals = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finals == [whole.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_n_samples_are_seeded_and_distinct(client, served):
    args = dict(model=served.model_name, prompt="one", max_tokens=6, temperature=1.0, seed=11, n=3)
    first = client.completions.create(**args)
    again = client.completions.create(**args)
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]


def test_chat_greedy_equals_hf_on_the_rendered_template(client, served):
    from models.templates import TEMPLATES, Message

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]
    text = "".join(s.text for s in TEMPLATES["chatml"].render([Message(**m) for m in messages]))
    ids = _encode(served, text)
    out = client.chat.completions.create(
        model=served.model_name,
        messages=messages,
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    expected = hf_generate(served.hf, ids, max_new_tokens=8)[0, len(ids) :].tolist()
    expected = expected[: expected.index(EOS_ID) + 1] if EOS_ID in expected else expected
    [choice] = out.choices
    assert choice.message.content == served.engine.tokens.decode(expected)
    reference = _hf_logprobs(served.hf, ids + expected)
    for t, entry in enumerate(choice.logprobs.content):
        row = reference[len(ids) - 1 + t]
        assert entry.logprob == pytest.approx(float(row[expected[t]]), abs=1e-4)
        # Greedy: the chosen token is the first alternative.
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-6)
    streamed = client.chat.completions.create(
        model=served.model_name, messages=messages, max_tokens=8, temperature=0, stream=True
    )
    text_parts = [c.choices[0].delta.content or "" for c in streamed if c.choices]
    assert "".join(text_parts) == choice.message.content


def test_beam_search_via_use_beam_search(served):
    ids = _encode(served, "the cat")
    body = {
        "model": served.model_name,
        "prompt": ids,
        "max_tokens": 6,
        "n": 2,
        "best_of": 3,
        "use_beam_search": True,
    }
    out = requests.post(f"{served.http_url}/v1/completions", json=body, timeout=60).json()
    expected = hf_generate(
        served.hf, ids, max_new_tokens=6, num_beams=3, num_return_sequences=2, early_stopping=False
    )
    texts = [served.engine.tokens.decode(row[len(ids) :].tolist()) for row in expected]
    assert [c["text"] for c in out["choices"]] == texts


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"prompt": "x", "temperature": 5}, 400, "temperature"),
        ({"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
        ({"prompt": [999999]}, 400, "prompt[0]"),
        ({"prompt": "x", "max_tokens": 100000}, 400, "max_tokens"),
        ({"prompt": "x", "n": 2, "temperature": 0}, 400, "n"),
        ({"prompt": "x", "model": "gpt-5"}, 404, "model"),
        ({"prompt": "x", "frequency_penalty": 1}, 400, "frequency_penalty"),
        ({}, 400, "prompt"),
    ],
)
def test_bad_requests_get_openai_errors(served, body, status, param):
    body = {"model": served.model_name, **body}
    response = requests.post(f"{served.http_url}/v1/completions", json=body, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"] and error["type"]


def test_malformed_json_is_400_and_unknown_route_404(served):
    bad = requests.post(
        f"{served.http_url}/v1/completions",
        data=b"{not json",
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert bad.status_code == 400 and "error" in bad.json()
    assert requests.get(f"{served.http_url}/v2/nothing", timeout=30).status_code == 404


def test_openai_client_raises_typed_errors(client, served):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=served.model_name, prompt="x", temperature=9)


def _lm_eval_local_completions(served):
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    return LocalCompletionsAPI(
        base_url=f"{served.http_url}/v1/completions",
        model=served.model_name,
        tokenizer_backend="remote",
        tokenized_requests=True,
        num_concurrent=1,
        max_retries=1,
        batch_size=2,
    )


def _instance(kind: str, arguments: tuple, idx: int = 0):
    from lm_eval.api.instance import Instance

    return Instance(request_type=kind, doc={}, arguments=arguments, idx=idx)


def _continuation_text(tokens, context: str, token_id: int) -> str | None:
    """Text that lm-eval tokenizes (as encode(context + text) minus encode(context)) to exactly
    [token_id], or None when the tokenizer would merge it differently."""
    ids = tokens.require().encode(context)
    text = tokens.decode([*ids, token_id])[len(tokens.decode(ids)) :]
    whole = tokens.require().encode(context + text)
    return text if text and whole == [*ids, token_id] else None


def test_lm_eval_local_completions_loglikelihood_and_is_greedy(served):
    lm = _lm_eval_local_completions(served)
    tokens = served.engine.tokens
    cases = []  # (context, continuation, expected log-prob, expected is_greedy)
    for context in ("one two three", "the cat sat on", "a b c d", "hello there"):
        ids = tokens.require().encode(context)
        row = _hf_logprobs(served.hf, ids)[-1]
        ranked = row.argsort(descending=True).tolist()
        greedy = _continuation_text(tokens, context, ranked[0])
        other = next(
            (t, text)
            for t in ranked[1:]
            if t > 3 and (text := _continuation_text(tokens, context, t)) is not None
        )
        if greedy is not None:
            cases.append((context, greedy, float(row[ranked[0]]), True))
        cases.append((context, other[1], float(row[other[0]]), False))
    assert any(c[3] for c in cases) and not all(c[3] for c in cases)
    results = lm.loglikelihood(
        [_instance("loglikelihood", (c, x), i) for i, (c, x, _, _) in enumerate(cases)]
    )
    for (_, _, logprob, greedy), (got_logprob, got_greedy) in zip(cases, results, strict=True):
        assert got_logprob == pytest.approx(logprob, abs=1e-4)
        assert got_greedy is greedy


def test_lm_eval_local_completions_generate_until_equals_hf(served):
    lm = _lm_eval_local_completions(served)
    tokens = served.engine.tokens
    context = "the cat sat"
    [text] = lm.generate_until(
        [_instance("generate_until", (context, {"until": ["\n\n"], "max_gen_toks": 8}))]
    )
    ids = tokens.require().encode(context)
    expected = hf_generate(served.hf, ids, max_new_tokens=8)[0, len(ids) :].tolist()
    expected = expected[: expected.index(EOS_ID) + 1] if EOS_ID in expected else expected
    assert text == tokens.decode(expected).split("\n\n")[0]


def test_streamed_logprobs_equal_the_plain_answer(client, served):
    args = dict(model=served.model_name, prompt=[5, 9, 14], max_tokens=6, temperature=0, logprobs=2)
    whole = client.completions.create(**args).choices[0].logprobs
    chunks = [c.choices[0] for c in client.completions.create(**args, stream=True) if c.choices]
    streamed = [lp for c in chunks if c.logprobs for lp in c.logprobs.token_logprobs]
    assert streamed == pytest.approx(whole.token_logprobs, abs=1e-6)
    tops = [t for c in chunks if c.logprobs for t in c.logprobs.top_logprobs]
    assert tops == whole.top_logprobs


def test_vllm_tokenizer_routes(served):
    url = served.http_url
    tokens = requests.post(f"{url}/tokenize", json={"prompt": "the cat"}, timeout=10).json()
    assert tokens["tokens"] == served.engine.tokens.encode_prompt("the cat")
    plain = requests.post(
        f"{url}/tokenize", json={"prompt": "the cat", "add_special_tokens": False}, timeout=10
    ).json()
    assert plain["tokens"] == tokens["tokens"][1:]
    text = requests.post(f"{url}/detokenize", json={"tokens": plain["tokens"]}, timeout=10).json()
    assert text["prompt"] == "the cat"
    bad = requests.post(f"{url}/detokenize", json={"tokens": [10**9]}, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    info = requests.get(f"{url}/tokenizer_info", timeout=10).json()
    assert info["eos_token"] == "</s>" and info["chat_template"] is None


def test_no_model_loaded_is_503(served):
    import asyncio

    from services.common.config import ServerConfig
    from services.inference.config import InferenceServiceConfig
    from services.inference.http_config import HttpConfig
    from services.inference.http_server import start_http

    async def start():
        return await start_http(
            None, InferenceServiceConfig(), HttpConfig(http_port=0), ServerConfig(port=0)
        )

    front = asyncio.run_coroutine_threadsafe(start(), served.loop).result(30)
    try:
        url = f"http://127.0.0.1:{front.port}"
        assert requests.get(f"{url}/health", timeout=10).status_code == 503
        body = {"model": "x", "prompt": "hi"}
        response = requests.post(f"{url}/v1/completions", json=body, timeout=10)
        assert response.status_code == 503 and response.json()["error"]["code"] == "no_model"
    finally:
        asyncio.run_coroutine_threadsafe(front.stop(1), served.loop).result(30)
