"""64 concurrent conversations whose KV would not fit unpaged, served with no failures (#39).

`meshline serve inference --load SmolLM2 --max-model-len 2048 --kv-cache-memory 192MiB
--max-batch-rows 64`: a dense cache row of 2,048 tokens takes 90 MiB, so the budget holds 2
dense rows, not the 5.6 GiB that 64 would take; the paged cache holds 273 blocks of 16 tokens
and the 64 conversations (two turns each, the second resending the first answer) share it,
waiting for blocks when short. Every request goes over HTTP through the official `openai`
client, all 64 conversations at once; each must succeed, the server must have decoded more
rows in one step than 2 (what the same memory would hold dense), and a conversation replayed
alone afterwards gets the same greedy answers as under that pressure.
"""

from __future__ import annotations

import asyncio
import sys

import openai
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from tests.served_process import HTTP_PORT, METRICS_PORT, launched

CONVERSATIONS = 64
NEW_TOKENS = 12
DENSE_ROWS = 2  # 192 MiB // (2048 tokens x 30 layers x K,V x 3 heads x 64 x 4 bytes)
TOPICS = ("rivers", "bread", "chess", "volcanoes", "owls", "trains", "jazz", "glaciers")


def _question(k: int) -> str:
    return f"Conversation {k}: tell me one fact about {TOPICS[k % len(TOPICS)]}."


async def _conversation(client: openai.AsyncOpenAI, model: str, k: int) -> list[str]:
    """Two greedy turns; the second resends the first answer as history."""
    messages: list[dict[str, str]] = [{"role": "user", "content": _question(k)}]
    answers = []
    for follow_up in ("And another one, shorter?", None):
        reply = await client.chat.completions.create(
            model=model, messages=messages, max_tokens=NEW_TOKENS, temperature=0
        )
        text = reply.choices[0].message.content or ""
        assert reply.usage is not None and reply.usage.completion_tokens > 0, reply
        answers.append(text)
        if follow_up is not None:
            messages += [
                {"role": "assistant", "content": text},
                {"role": "user", "content": follow_up},
            ]
    return answers


async def _all(port: int, model: str, ks: list[int]) -> list[list[str]]:
    client = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=1800
    )
    try:
        return list(await asyncio.gather(*(_conversation(client, model, k) for k in ks)))
    finally:
        await client.close()


def _batch_rows_above(port: int, rows: int) -> float:
    """Engine steps that decoded more than `rows` rows, from the batch-size histogram."""
    text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    buckets = {
        float(s.labels["le"]): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "meshline_inference_batch_size_bucket"
    }
    return buckets[float("inf")] - max(v for le, v in buckets.items() if le <= rows)


@pytest.mark.slow
def test_64_conversations_beyond_dense_memory(smollm2_dir):
    command = [sys.executable, "-m", "services.inference", "serve", "--port", "0"]
    command += ["--load", str(smollm2_dir), "--http-port", "0", "--metrics-port", "0"]
    command += ["--max-model-len", "2048", "--kv-cache-memory", "192MiB"]
    command += ["--max-batch-rows", str(CONVERSATIONS), "--served-model-name", "smol"]
    command += ["--grace-period", "5"]
    with launched(command, {"http": HTTP_PORT, "metrics": METRICS_PORT}) as server:
        [reserved] = [line for line in server.lines if "KV cache:" in line]
        assert "KV cache: paged, 273 blocks of 16 tokens" in reserved, reserved
        assert "budget 192.0 MiB (--kv-cache-memory)" in reserved, reserved
        ports = server.ports
        answers = asyncio.run(_all(ports["http"], "smol", list(range(CONVERSATIONS))))
        assert len(answers) == CONVERSATIONS and all(a and b for a, b in answers), answers
        assert _batch_rows_above(ports["metrics"], DENSE_ROWS) > 0, server.tail()
        alone = asyncio.run(_all(ports["http"], "smol", [0, CONVERSATIONS - 1]))
        assert alone == [answers[0], answers[-1]]
        assert server.process.poll() is None, server.tail()
