"""The served benches' harness (bench/served.py, bench/bench_prefix_cache.py) measures what it
says: one streamed chunk per generated token, TTFT and throughput from the client's clock, the
inter-token gaps split at the long prompt's arrival. A tiny model on a real HTTP front; speed
is not asserted."""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.bench_prefix_cache import long_prompt_itl, shared_prefix
from bench.served import MODEL, Server, Stream, percentile, stream_completion
from tests.services.inference.helpers import hf_reference, save_hf_checkpoint
from tests.services.inference.http_served import ServerHarness, make_checkpoint

ROOT = Path(__file__).resolve().parents[2]
EOS_ID = 2  # the fixture SentencePiece model's (ids 0-3: unk, bos, eos, pad)


@pytest.fixture(scope="module")
def served(tmp_path_factory, sentencepiece_model):
    hf, _, config = hf_reference("llama-gqa", seed=11, vocab_size=512, max_position_embeddings=1024)
    with torch.no_grad():  # EOS (id 2) never wins: every stream runs to its max_tokens
        hf.lm_head.weight[EOS_ID] = 0.0
    directory = save_hf_checkpoint(hf, tmp_path_factory.mktemp("ckpt"), sentencepiece_model)
    harness = ServerHarness(directory, hf, config, served_model_name=MODEL)
    front = harness.start()
    port = int(front.http_url.rsplit(":", 1)[1])
    yield Server(port, "", ()), config.vocab_size
    harness.close()


def test_percentile_is_nearest_rank():
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 0.99) == 99.0
    assert percentile(values, 0.5) == 50.0
    assert percentile([3.0, 1.0], 0.99) == 3.0


def test_stream_counts_one_chunk_per_token(served):
    server, _ = served

    async def run() -> Stream:
        client = server.client()
        try:
            return await stream_completion(client, [5, 6, 7, 8], 6)
        finally:
            await client.close()

    stream = asyncio.run(run())
    assert stream.prompt_tokens == 4
    assert 1 <= stream.completion_tokens <= 6
    assert len(stream.arrivals) == stream.completion_tokens  # the ITL is per token
    assert stream.arrivals == sorted(stream.arrivals) and stream.ttft > 0
    assert stream.finish_reason in ("length", "stop")


def test_shared_prefix_and_long_prompt_measurements(served):
    server, vocab = served
    args = argparse.Namespace(
        requests=4,
        system_tokens=40,
        question_tokens=4,
        new_tokens=3,
        streams=2,
        warm_tokens=2,
        idle_tokens=3,
        stream_tokens=800,
        long_tokens=120,
    )
    prefix = asyncio.run(shared_prefix(server, args, vocab))
    assert 0 < prefix["ttft_p50"] <= prefix["wall"]
    # 4 prompts of 44 tokens and up to 3 new tokens each, over the wall time
    assert 4 * 44 / prefix["wall"] <= prefix["tok_s"] <= 4 * 47 / prefix["wall"]
    itl = asyncio.run(long_prompt_itl(server, args, vocab))
    assert itl["n_before"] >= args.streams * args.idle_tokens
    assert itl["n_during"] >= args.streams  # every stream's gap across the prefill
    assert itl["before"] > 0 and itl["during"] > 0 and itl["long_ttft"] > 0


@pytest.mark.slow
def test_prefix_cache_bench_runs_against_a_server_process(tmp_path_factory, sentencepiece_model):
    directory, _, _ = make_checkpoint(tmp_path_factory, sentencepiece_model, seed=11)
    command = [sys.executable, "-m", "bench.bench_prefix_cache", "--quick", "--skip", "chunked"]
    done = subprocess.run(
        [*command, "--load", str(directory)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "KV cache: paged" in done.stdout and "--no-enable-prefix-caching" in done.stdout
    assert "ratio: TTFT p50 " in done.stdout, done.stdout
