"""The load generator (bench/bench_loadgen.py): its mix is seeded and capped, its accounting
is right on a timeline worked by hand, and a real run against a tiny model served on localhost
(gRPC and the OpenAI HTTP front on one engine) returns every request with the server's token
counts. Speed is not asserted."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.bench_loadgen import (
    MODEL,
    Target,
    markdown,
    materialize,
    parse_args,
    replay,
)
from bench.loadgen_metrics import RequestRecord, percentile, summarize
from bench.loadgen_mix import LengthShape, build_mix, corpus_text, prompt_slices
from tests.services.inference.helpers import hf_reference, save_hf_checkpoint
from tests.services.inference.http_served import ServerHarness

ROOT = Path(__file__).resolve().parents[2]
EOS_ID = 2  # the fixture SentencePiece model's (ids 0-3: unk, bos, eos, pad)
PROMPT = LengthShape(median=256, sigma=1.0, minimum=4, cap=1024)
OUTPUT = LengthShape(median=200, sigma=0.8, minimum=1, cap=512)


def test_mix_is_deterministic_by_seed_and_capped():
    mix = build_mix(2000, 7, PROMPT, OUTPUT)
    assert mix == build_mix(2000, 7, PROMPT, OUTPUT)
    assert mix != build_mix(2000, 8, PROMPT, OUTPUT)
    prompts = [s.prompt_tokens for s in mix]
    outputs = [s.output_tokens for s in mix]
    assert min(prompts) >= 4 and max(prompts) == 1024  # the tail reaches the cap and stops
    assert min(outputs) >= 1 and max(outputs) == 512
    # ShareGPT's shape: medians near the configured ones, means above them (a right tail)
    assert 220 <= statistics.median(prompts) <= 290 < statistics.mean(prompts)
    assert 180 <= statistics.median(outputs) <= 220 < statistics.mean(outputs)
    assert all(0 <= s.offset < 1 for s in mix)
    tight = build_mix(500, 7, LengthShape(256, 1.0, 8, 32), LengthShape(200, 0.8, 2, 16))
    assert {s.prompt_tokens for s in tight} <= set(range(8, 33))
    assert {s.output_tokens for s in tight} <= set(range(2, 17))


def test_length_shape_refuses_bad_bounds():
    with pytest.raises(ValueError, match="minimum <= cap"):
        LengthShape(10, 1.0, 50, 20)
    with pytest.raises(ValueError, match="median must be > 0"):
        LengthShape(0, 1.0, 1, 20)


def test_prompt_slices_cut_windows_of_the_drawn_length():
    specs = build_mix(50, 3, LengthShape(20, 1.0, 4, 60), OUTPUT)
    corpus = list(range(1000))
    windows = prompt_slices(specs, corpus)
    for spec, window in zip(specs, windows, strict=True):
        assert len(window) == spec.prompt_tokens
        assert window == list(range(window[0], window[0] + len(window)))  # contiguous
    with pytest.raises(ValueError, match="lower --max-prompt-tokens"):
        prompt_slices(specs, corpus[:10])
    assert len(corpus_text(5000)) == 5000  # shipped text, no download


def test_accounting_on_a_hand_worked_timeline():
    # Request A: sent at 0, tokens at 0.5, 0.6, 0.8, 1.1 (gaps 100, 200, 300 ms), ends at 1.1.
    a = RequestRecord(0.0, [0.5, 0.6, 0.8, 1.1], [1, 1, 1, 1], 1.1, 10, 4, "length")
    # Request B: sent at 0.2, tokens at 0.4 and 0.9 (gap 500 ms), ends at 2.0.
    b = RequestRecord(0.2, [0.4, 0.9], [1, 1], 2.0, 6, 2, "stop")
    # Request C failed: counted as an error, in nothing else.
    c = RequestRecord(0.3, [], [], None, error="APIConnectionError: refused")
    level = summarize(2, [a, b, c])
    assert level["requests"] == 3 and level["succeeded"] == 2 and level["errors"] == 1
    assert level["error_kinds"] == {"APIConnectionError": 1}
    assert level["wall_s"] == pytest.approx(2.0)  # first send 0.0 to last end 2.0
    assert level["output_tokens"] == 6 == level["usage_tokens"]
    assert level["output_tok_s"] == pytest.approx(3.0)
    assert level["requests_s"] == pytest.approx(1.0)
    # TTFTs 500 and 200 ms; nearest rank: p50 is the smaller, p99 the larger
    assert level["ttft_p50_ms"] == pytest.approx(200) and level["ttft_p99_ms"] == pytest.approx(500)
    # ITL pooled over requests: 100, 200, 300, 500 ms
    assert level["itl_p50_ms"] == pytest.approx(200) and level["itl_p99_ms"] == pytest.approx(500)
    # TPOT: A (1.1 - 0.5) / 3 = 200 ms, B (0.9 - 0.4) / 1 = 500 ms
    assert level["tpot_p50_ms"] == pytest.approx(200)
    assert level["mean_output_tokens"] == 3
    grpc_side = summarize(1, [RequestRecord(0.0, [0.1, 0.3], [2, 3], 0.3)])  # no usage counts
    assert grpc_side["output_tokens"] == 5 and grpc_side["usage_tokens"] is None
    assert grpc_side["tpot_p50_ms"] == pytest.approx(200 / 4)
    assert percentile([], 0.5) != percentile([], 0.5)  # NaN: no values, no number


def test_flags_are_checked_before_any_server_starts():
    def refused(argv: list[str]) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "bench.bench_loadgen", *argv],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 2, done.stderr
        return done.stderr

    assert "--smollm2, --load DIR or --url URL" in refused([])
    assert "--concurrency takes stream counts" in refused(["--smollm2", "--concurrency", "0"])
    assert "needs --grpc-address" in refused(["--url", "http://x:1", "--transport", "grpc"])
    assert "minimum <= cap" in refused(["--smollm2", "--max-prompt-tokens", "2"])
    assert "not to --url" in refused(["--url", "http://x:1", "--server-flag=--max-batch-rows=4"])
    args = parse_args(["--quick"])
    assert args.smollm2 and args.concurrency == [1, 2, 4] and args.max_output_tokens == 32


@pytest.fixture(scope="module")
def served(tmp_path_factory, sentencepiece_model):
    hf, _, config = hf_reference("llama-gqa", seed=11, vocab_size=512, max_position_embeddings=1024)
    with torch.no_grad():  # EOS never wins: every stream makes exactly its max_tokens
        hf.lm_head.weight[EOS_ID] = 0.0
    directory = save_hf_checkpoint(hf, tmp_path_factory.mktemp("ckpt"), sentencepiece_model)
    harness = ServerHarness(directory, hf, config, served_model_name=MODEL)
    front = harness.start()
    yield Target(front.http_url, f"127.0.0.1:{front.grpc_port}", MODEL, "in-process harness")
    harness.close()


def test_replay_against_a_served_model(served):
    args = argparse.Namespace(
        concurrency=[1, 4], requests_per_stream=2, seed=5, prompt_median=24.0, prompt_sigma=1.0,
        min_prompt_tokens=4, max_prompt_tokens=48, output_median=6.0, output_sigma=0.5,
        min_output_tokens=2, max_output_tokens=12, temperature=0.0, timeout_s=120.0,
        transport=["http", "grpc"],
    )  # fmt: skip
    report = replay(args, served)
    specs = build_mix(8, 5, LengthShape(24.0, 1.0, 4, 48), LengthShape(6.0, 0.5, 2, 12))
    for name in ("http", "grpc"):
        levels = report["transports"][name]
        assert [level["concurrency"] for level in levels] == [1, 4]
        for level in levels:
            n = level["concurrency"] * 2
            assert level["requests"] == level["succeeded"] == n and level["errors"] == 0
            # EOS is masked: each request makes exactly the max_tokens the mix drew for it
            assert level["output_tokens"] == sum(s.output_tokens for s in specs[:n])
            if name == "http":
                assert level["usage_tokens"] == level["output_tokens"]  # the server's count
                drawn = sum(s.prompt_tokens for s in specs[:n])
                assert abs(level["prompt_tokens"] - drawn) <= 2 * n  # re-tokenized text, BOS
            assert level["output_tok_s"] > 0 and level["requests_s"] > 0
            assert 0 < level["ttft_p50_ms"] <= level["ttft_p99_ms"] <= level["wall_s"] * 1e3
            assert 0 < level["itl_p50_ms"] <= level["itl_p99_ms"]
    page = markdown(report)
    assert "## http" in page and "## grpc" in page and "| 4 | 8 | 0 |" in page


def test_prompts_are_the_drawn_windows_as_text(served):
    specs = build_mix(6, 1, LengthShape(30.0, 1.0, 4, 60), OUTPUT)
    texts = materialize(served, specs)
    assert texts == materialize(served, specs)  # same seed, same server: same prompts
    assert all(text.strip() for text in texts)
    assert len(set(texts)) == len(texts)


def test_main_against_a_running_server_writes_json_and_markdown(served, tmp_path):
    from bench.bench_loadgen import main

    argv = ["--url", served.http_url + "/v1", "--grpc-address", str(served.grpc_address)]
    argv += ["--transport", "http", "grpc", "--concurrency", "2", "--requests-per-stream", "1"]
    argv += ["--prompt-median", "8", "--max-prompt-tokens", "16", "--output-median", "3"]
    argv += ["--max-output-tokens", "4", "--out", str(tmp_path)]
    assert main(argv) == 0
    report = json.loads((tmp_path / "loadgen.json").read_text())
    assert report["server"] == served.http_url  # /v1 stripped; the model id from /v1/models
    for name in ("http", "grpc"):
        (level,) = report["transports"][name]
        assert level["succeeded"] == 2 and level["errors"] == 0 and level["output_tokens"] >= 2
    assert "| 2 | 2 | 0 |" in (tmp_path / "loadgen.md").read_text()
