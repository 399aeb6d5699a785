"""Allocate-as-you-go KV blocks over the served endpoint: more concurrent requests than the cache
holds at their full max_tokens all complete through the official `openai` client, each answer
equal to the request served alone, and /metrics counts the preemptions that made room."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from services.common.metrics import start_metrics_server
from services.inference.config import InferenceServiceConfig
from tests.services.inference.helpers import prompt
from tests.services.inference.http_served import ServerHarness, make_checkpoint

BLOCKS = 12
PREEMPTIONS = "meshline_inference_preemptions_total"


@pytest.fixture(scope="module")
def served(tmp_path_factory, sentencepiece_model):
    directory, hf, config = make_checkpoint(tmp_path_factory, sentencepiece_model, seed=4)
    slot = config.num_layers * 2 * config.kv_heads * config.head_dim * 4  # fp32 K and V
    limits = InferenceServiceConfig(
        load=directory, max_batch_rows=8, max_model_len=64, kv_cache_memory=BLOCKS * 16 * slot
    )
    harness = ServerHarness(directory, hf, config, limits=limits)
    served = harness.start()
    assert served.engine.engine.cache_plan.blocks == BLOCKS
    metrics = start_metrics_server("127.0.0.1", 0)
    yield served, f"http://127.0.0.1:{metrics.server_port}/metrics"
    metrics.shutdown()
    metrics.server_close()
    harness.close()


def _preemptions(url: str) -> float:
    text = requests.get(url, timeout=10).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == PREEMPTIONS
    )


def test_requests_beyond_the_cache_complete_exactly_and_preemptions_are_counted(served):
    served, url = served
    client = openai.OpenAI(base_url=f"{served.http_url}/v1", api_key="none", max_retries=0)
    # 14 prompt + 40 new tokens: 4 blocks each at full length (6 x 4 > 12), 1 at admission; five
    # of them past 32 tokens need 15 blocks, so they overlap enough even when sent unevenly.
    prompts = [prompt(14, 512, seed=s) for s in range(6)]

    def complete(ids: list[int]) -> list[int]:
        answer = client.completions.create(
            model=served.model_name, prompt=ids, max_tokens=40, temperature=0, logprobs=0
        )
        assert answer.choices[0].finish_reason == "length"
        return answer.choices[0].logprobs.tokens

    before = _preemptions(url)
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(complete, prompts))
    preempted = _preemptions(url) - before
    alone = [complete(ids) for ids in prompts]
    assert together == alone
    assert all(len(tokens) == 40 for tokens in together)
    assert preempted >= 1 and preempted == served.engine.engine.preemptions
