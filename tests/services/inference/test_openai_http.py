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
