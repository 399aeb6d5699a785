"""Multi-process serving: 2 gloo processes (TP=2 or PP=2) give the same tokens and scores as 1.

Each rank loads the full HF checkpoint, keeps its shard (TP plan) or its stage (layer range),
and runs the engine; rank 0 leads (broadcasts requests), rank 1 follows. Llama covers GQA with a
packed qkv and packed gate/up split per part; Bloom covers ALiBi head offsets, biases, and an
embedding tied to the vocabulary-parallel head (TP) or copied to the last stage (PP). The server
tests start `serve inference --tensor-parallel-size 2` / `--pipeline-parallel-size 2` as real
processes and call them over gRPC.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import torch

from engine.engine import Engine
from engine.sampling import SamplingConfig
from engine.tokens import TokenizerInfo
from meshline.inference.v1 import inference_pb2 as pb
from meshline.inference.v1 import inference_pb2_grpc as pb_grpc
from services.inference.config import InferenceServiceConfig
from tests.harness import run_distributed
from tests.services.inference.helpers import hf_reference, prompt, save_hf_checkpoint

pytestmark = pytest.mark.dist
ROOT = Path(__file__).resolve().parents[3]
CONFIGS = [
    SamplingConfig(max_new_tokens=10),
    SamplingConfig(max_new_tokens=8, num_beams=3, num_return_sequences=2),
    SamplingConfig(max_new_tokens=10, do_sample=True, top_k=10, seed=4, num_return_sequences=2),
]
SCORE_ATOL = 1e-4


def _prompts(vocab: int) -> list[list[int]]:
    return [prompt(n, vocab, seed=n) for n in (4, 7, 5)]


def _score_items(vocab: int):
    return [
        (prompt(5, vocab, seed=20), prompt(3, vocab, seed=21)),
        ([7], prompt(6, vocab, seed=22)),
        (prompt(5, vocab, seed=20), prompt(2, vocab, seed=23)),  # shares the first context
    ]


def _worker(rank: int, world: int, directory: str, layout: str):
    from kernels import device as devices
    from services.inference.parallel_serving import build_rank_engine

    devices.init_distributed()
    sizes = {
        "tp": {"tensor_parallel_size": world},
        "pp": {"pipeline_parallel_size": world},
        "tp2pp2": {"tensor_parallel_size": 2, "pipeline_parallel_size": 2},
    }
    config = InferenceServiceConfig(load=Path(directory), **sizes[layout])
    engine, loaded = build_rank_engine(config)
    vocab = loaded.config.vocab_size
    if rank != 0:
        engine.follow()
        return None
    results = engine.generate(_prompts(vocab), CONFIGS)
    scores = engine.score(_score_items(vocab))
    engine.shutdown()
    return (
        [[r.token_ids for r in per_request] for per_request in results],
        [(s.logprob, s.token_logprobs) for s in scores],
        loaded.model.layers["0"].self_attn.o_proj.weight.shape,
        sorted(loaded.model.layers.keys()),
    )


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp", "pp"])
@pytest.mark.parametrize("name", ["llama-gqa", "bloom", "mistral", "gpt"])
def test_two_processes_match_one(tmp_path, name, layout):
    """Mistral: prompts and generations run past the sliding window (8), so every rank's KV
    cache is a ring of 8 slots (models/kv_ring.py)."""
    hf, ours, config = hf_reference(name, seed=5)
    directory = save_hf_checkpoint(hf, tmp_path / "ckpt")
    tokens, scores, o_proj_shape, layers = run_distributed(_worker, 2, str(directory), layout)[0]
    engine = Engine(ours, TokenizerInfo(config.vocab_size))
    expected = engine.generate(_prompts(config.vocab_size), CONFIGS)
    assert tokens == [[r.token_ids for r in per_request] for per_request in expected]
    for (logprob, per_token), ref in zip(
        scores, engine.score(_score_items(config.vocab_size)), strict=True
    ):
        assert logprob == pytest.approx(ref.logprob, abs=SCORE_ATOL)
        assert per_token == pytest.approx(ref.token_logprobs, abs=SCORE_ATOL)
    if layout == "tp":  # really sharded / really split
        assert tuple(o_proj_shape) == (config.hidden_size, config.hidden_size // 2)
        assert layers == ["0", "1"]
    else:
        assert tuple(o_proj_shape) == (config.hidden_size, config.hidden_size)
        assert layers == ["0"]


@pytest.mark.slow
@pytest.mark.xdist_group("dist")
@pytest.mark.parametrize("name", ["llama-gqa", "bloom"])
def test_tp2_x_pp2_matches_one_process(tmp_path, name):
    """4 processes: 2 pipeline stages, each sharded over 2 tensor-parallel ranks."""
    hf, ours, config = hf_reference(name, seed=5)
    directory = save_hf_checkpoint(hf, tmp_path / "ckpt")
    tokens, scores, o_proj_shape, layers = run_distributed(_worker, 4, str(directory), "tp2pp2")[0]
    engine = Engine(ours, TokenizerInfo(config.vocab_size))
    expected = engine.generate(_prompts(config.vocab_size), CONFIGS)
    assert tokens == [[r.token_ids for r in per_request] for per_request in expected]
    for (logprob, per_token), ref in zip(
        scores, engine.score(_score_items(config.vocab_size)), strict=True
    ):
        assert logprob == pytest.approx(ref.logprob, abs=SCORE_ATOL)
        assert per_token == pytest.approx(ref.token_logprobs, abs=SCORE_ATOL)
    assert tuple(o_proj_shape) == (config.hidden_size, config.hidden_size // 2)
    assert layers == ["0"]


@pytest.mark.slow
@pytest.mark.parametrize("flag", ["--tensor-parallel-size", "--pipeline-parallel-size"])
def test_served_with_two_processes(tmp_path, flag):
    hf, ours, config = hf_reference("llama-gqa", seed=6)
    directory = save_hf_checkpoint(hf, tmp_path / "ckpt")
    command = [sys.executable, "-m", "services.inference", "serve", "--port", "0"]
    command += ["--host", "127.0.0.1", "--load", str(directory), flag, "2"]
    server = subprocess.Popen(
        command,
        cwd=ROOT,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        port = None
        assert server.stderr is not None
        for line in server.stderr:
            match = re.search(r"serving .* on \S+:(\d+)", line)
            if match:
                port = int(match.group(1))
                break
        assert port, "server never reported its port"
        ids = prompt(6, config.vocab_size, seed=2)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.InferenceServiceStub(channel)
            info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=60)
            reply = stub.Generate(
                pb.GenerateRequest(
                    prompt_token_ids=ids, params=pb.SamplingParams(max_new_tokens=12)
                ),
                timeout=120,
            )
        layout = info.parallel_layout
        assert (layout.tensor_parallel_size, layout.pipeline_parallel_size) == (
            (2, 1) if flag == "--tensor-parallel-size" else (1, 2)
        )
        [[expected]] = Engine(ours, TokenizerInfo(config.vocab_size)).generate(
            [ids], [SamplingConfig(max_new_tokens=12)]
        )
        assert list(reply.sequences[0].token_ids) == expected.token_ids
        server.send_signal(signal.SIGTERM)
        assert server.wait(60) == 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def _norm_head_worker(rank: int, world: int):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from engine.engine import head_logits
    from engine.tensor_parallel import shard_for_serving
    from models import build_model
    from models.registry import get_config

    config = get_config("tiny-baichuan", norm_head=True)
    model = build_model(config, device="cpu").eval()
    model.init_weights(seed=3)
    gen = torch.Generator().manual_seed(7)
    ids = torch.tensor([prompt(9, config.vocab_size, seed=1)])
    hidden = torch.randn(2, config.hidden_size, generator=gen)
    with torch.no_grad():  # rows of very different norms, so normalising them matters
        model.lm_head.weight.mul_(torch.rand(config.vocab_size, 1, generator=gen) * 4 + 0.1)
        expected = (model(ids), hidden @ F.normalize(model.lm_head.weight, dim=-1).T)
        shard_for_serving(model, dist.group.WORLD)
        served = (model(ids), head_logits(model, hidden))
    return expected, served, model.lm_head.weight.shape[0], config.vocab_size


def test_normalised_head_served_under_tp2_equals_one_process():
    """Baichuan2's NormHead under TP2: the model's forward and the engine's head give every
    rank the one-process logits from half the vocabulary rows."""
    for expected, served, local_rows, vocab in run_distributed(_norm_head_worker, 2):
        assert local_rows == vocab // 2
        for want, got in zip(expected, served, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
