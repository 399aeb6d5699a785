"""The device check's decode-roofline phase (bench/device_check.py `--phases roofline`).

In one child process, on an 8B-shaped Llama (Llama-3-8B's shape, random weights, bf16; tiny
and fp32 in smoke mode):
1. the device's copy bandwidth (bench/roofline.py's BW);
2. batch-1 greedy decode in-process (Meshline's Engine as served: CUDA graphs on a GPU), the
   time per token as (time for `new` tokens - time for 1) / (new - 1), so the prompt's
   prefill is not counted; its fraction of the roofline (bench/roofline.py);
3. decode throughput at batch 8/32/64 the same way (rows / time per step);
4. the same weights written as a HF checkpoint, with a byte-level BPE trained here on docs/*.md
   (nothing downloaded), served by `python -m services.inference serve` (gRPC + HTTP): batch-1
   time per token over gRPC GenerateStream and streamed HTTP /v1/completions from the client's
   chunk times ((last - first) / (tokens - 1)), and in-process / served;
5. bench/bench_loadgen.py's mix at 1..64 streams against that server over HTTP.

Each step's result goes to `roofline.json` under the work folder as soon as it is measured, so a
run cut short by the time cap still reports what it measured.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from bench.roofline import LLAMA_8B, roofline, vendor_bandwidth
from kernels import device as devices

SHAPES: dict[str, dict[str, int]] = {
    "gpu": LLAMA_8B,
    "smoke": dict(hidden=64, layers=2, heads=4, kv=2, ffn=128, vocab=512, prompt=16, new=16),
}
BATCHES = {"gpu": (8, 32, 64), "smoke": (2, 4)}
CONTEXT = 2048
"""Positions the model (and the server's --max-model-len) allow: the loadgen's longest
request (1024 + 256) fits."""
LOADGEN = {
    "gpu": dict(
        concurrency=[1, 2, 4, 8, 16, 32, 64], requests_per_stream=2, prompt_median=256.0,
        max_prompt_tokens=1024, output_median=128.0, max_output_tokens=256,
    ),
    "smoke": dict(
        concurrency=[1, 2], requests_per_stream=1, prompt_median=16.0, max_prompt_tokens=32,
        output_median=4.0, max_output_tokens=8,
    ),
}  # fmt: skip
"""The loadgen flags of each mode (the GPU run's outputs capped at 256 to fit the time cap)."""
PARTIAL = "roofline.json"


def copy_bandwidth(device: Any, nbytes: int, repeats: int = 5, copies: int = 10) -> float:
    """Bytes/s of device-to-device copies of `nbytes` (each moves 2 x nbytes: read + write),
    the best of `repeats` timings of `copies` back-to-back copies."""
    import torch

    source = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=device)
    target = torch.empty_like(source)
    target.copy_(source)
    best = 0.0
    for _ in range(repeats):
        devices.synchronize()
        start = time.perf_counter()
        for _ in range(copies):
            target.copy_(source)
        devices.synchronize()
        best = max(best, 2 * nbytes * copies / (time.perf_counter() - start))
    return best


def model_config(shape: dict[str, int]) -> Any:
    """The Meshline model config of `shape` (a Llama with GQA, RMSNorm, SwiGLU, untied head)."""
    # this phase's stack only: every device-check child imports this module
    from models.registry import get_config

    return get_config(
        "tiny-llama-gqa", vocab_size=shape["vocab"], hidden_size=shape["hidden"],
        num_layers=shape["layers"], num_attention_heads=shape["heads"],
        num_kv_heads=shape["kv"], ffn_hidden_size=shape["ffn"],
        max_position_embeddings=CONTEXT, tie_word_embeddings=False,
    )  # fmt: skip


class Partial:
    """The phase's result, rewritten to `path` after every step."""

    def __init__(self, path: Path, initial: dict[str, Any]) -> None:
        self.path = path
        self.data = initial
        self.save()

    def set(self, key: str, value: Any) -> None:
        self.data[key] = value
        self.save()
        print(f"roofline: {key} done", file=sys.stderr, flush=True)

    def save(self) -> None:
        self.path.write_text(json.dumps(self.data, indent=2))


def release_memory(platform: Any) -> None:
    """Hand freed device memory back (the server process needs it): collect, then empty the
    accelerator's caching allocator (`platform` is a kernels.device Platform)."""
    gc.collect()
    if platform.type != "cpu":
        platform.module.empty_cache()


def step_seconds(decoder: Any, prompts: list[list[int]], new: int) -> float:
    """Seconds per greedy decode step of `len(prompts)` rows on `decoder` (an Engine): (best
    time for `new` tokens - best time for 1) / (new - 1), so the prefill is not counted; best
    of 3 each, after a warm-up (which captures the CUDA graphs for this row count)."""
    # this phase's stack only: every device-check child imports this module
    from engine.sampling import SamplingConfig

    def timed(tokens: int) -> float:
        settings = [SamplingConfig(max_new_tokens=tokens) for _ in prompts]
        devices.synchronize()
        start = time.perf_counter()
        decoder.generate(prompts, settings)
        devices.synchronize()
        return time.perf_counter() - start

    timed(new)
    full = min(timed(new) for _ in range(3))
    first = min(timed(1) for _ in range(3))
    return (full - first) / (new - 1)


def served_step_seconds(run: Any, send: Any, prompt: list[int], new: int) -> float:
    """Seconds per decode step of one served request, on the client's clock, as step_seconds
    measures in-process: (best time of a `new`-token request - best time of a 1-token
    request) / (tokens - 1), best of 3 after a warm-up. Whole-request times, not chunk gaps: a
    front that delivers chunks in bursts would make the gaps look faster than the steps.
    `run` runs a coroutine (asyncio.Runner.run), `send` is a bench_loadgen transport's."""

    def timed(tokens: int) -> tuple[float, int]:
        record = run(send(prompt, tokens))
        if record.error or record.done is None or record.tokens < 1:
            raise RuntimeError(record.error or "no tokens came back")
        return record.done - record.sent, record.tokens

    timed(new)
    timed(1)
    for _ in range(3):  # a difference of two noisy requests: measured again where noise wins
        full, made = min(timed(new) for _ in range(3))
        if made < 2:
            raise RuntimeError(f"the model stopped after {made} token (EOS); no step to time")
        first = min(timed(1)[0] for _ in range(3))
        if full > first:
            return (full - first) / (made - 1)
    raise RuntimeError(
        f"timing noise: a {made}-token request took {full:.4f} s, a 1-token one {first:.4f} s"
    )


def in_process(mode: str, partial: Partial, checkpoint: Path) -> float:
    """Steps 2-4's in-process side; writes the HF checkpoint; returns batch-1 s/token."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    # this phase's stack only: every device-check child imports this module
    from engine.engine import Engine, EngineConfig
    from engine.tokens import TokenizerInfo
    from models import build_model
    from models.hf_adapters import hf_config, to_hf

    shape, gpu = SHAPES[mode], mode == "gpu"
    dtype = torch.bfloat16 if gpu else torch.float32
    platform = devices.current()
    config = model_config(shape)
    torch.manual_seed(0)
    model = build_model(config, device=platform.torch_device(), dtype=dtype).eval()
    # The served copy's weights, taken before the engine may repack CPU linear layers.
    state = {k: v.to("cpu").contiguous() for k, v in to_hf(model.state_dict(), config).items()}
    rows = max(BATCHES[mode])
    decoder = Engine(
        model,
        TokenizerInfo(config.vocab_size),  # no EOS: every request makes all its tokens
        EngineConfig(
            max_batch_rows=rows,
            max_model_len=shape["prompt"] + shape["new"] + 16,
            kv_cache_memory=(4 * 2**30 if gpu else 64 * 2**20),
        ),
    )
    generator = torch.Generator().manual_seed(1)
    prompts = torch.randint(4, shape["vocab"], (rows, shape["prompt"]), generator=generator)
    ids = prompts.tolist()
    batch1 = step_seconds(decoder, ids[:1], shape["new"])
    element = 2 if gpu else 4
    bandwidth = partial.data["bandwidth"]["measured_bytes_s"]
    partial.set("batch1", roofline(shape, element, bandwidth, batch1))
    batches = []
    for count in BATCHES[mode]:
        step = step_seconds(decoder, ids[:count], shape["new"])
        batches.append({"rows": count, "step_ms": step * 1e3, "tokens_per_s": count / step})
        partial.set("batches", batches)
    del decoder, model
    release_memory(platform)
    checkpoint.mkdir(parents=True, exist_ok=True)
    save_file(state, str(checkpoint / "model.safetensors"))
    del state
    hf = LlamaConfig(**hf_config(config))
    hf.architectures = ["LlamaForCausalLM"]
    hf.dtype = "bfloat16" if gpu else "float32"
    hf.bos_token_id = hf.eos_token_id = hf.pad_token_id = None
    (checkpoint / "config.json").write_text(hf.to_json_string())
    return batch1


def served(mode: str, partial: Partial, checkpoint: Path, work: Path, batch1_s: float) -> None:
    """Step 4's served side and step 5, against one server process on the checkpoint."""
    from bench.bench_loadgen import GrpcTransport, HttpTransport, launched_server, replay
    from bench.bench_loadgen import markdown as loadgen_markdown
    from bench.loadgen_mix import corpus_text

    # this phase's stack only: every device-check child imports this module
    from models.tokenizer import train_bpe_tokenizer

    shape = SHAPES[mode]
    tokenizer = train_bpe_tokenizer(
        corpus_text().splitlines(), work / "tokenizer", min(4096, shape["vocab"])
    )
    flags = ["--tokenizer", str(tokenizer), "--max-batch-rows", str(max(BATCHES[mode]))]
    flags += ["--max-model-len", str(CONTEXT)]
    prompt, new = list(range(4, 4 + shape["prompt"])), shape["new"]
    with launched_server(checkpoint, flags) as target:
        runner = asyncio.Runner()
        try:
            results: dict[str, Any] = {}
            for name, kind in (("grpc", GrpcTransport), ("http", HttpTransport)):
                try:  # a GPU image may lack a front's client package: that row says so
                    transport = kind(target, 0.0, 600.0)
                    try:
                        step = served_step_seconds(runner.run, transport.send, prompt, new)
                    finally:
                        runner.run(transport.close())
                    results[name] = {"ms": step * 1e3, "ratio": batch1_s / step}
                except Exception as exc:
                    results[name] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
                partial.set("served", results)
        finally:
            runner.close()
        args = argparse.Namespace(
            **LOADGEN[mode], seed=0, prompt_sigma=1.0, min_prompt_tokens=4, output_sigma=0.8,
            min_output_tokens=1, temperature=0.0, timeout_s=600.0, transport=["http"],
        )  # fmt: skip
        try:
            report = replay(args, target)
        except Exception as exc:  # reported in its row; the decode figures stand
            partial.set("loadgen", {"error": f"loadgen: {type(exc).__name__}: {exc}"[:1500]})
            return
        partial.set("loadgen", {"report": report, "markdown": loadgen_markdown(report)})


def roofline_worker(mode: str, work: Path) -> dict[str, Any]:
    """The whole phase (see the module docstring); the result (also in work/roofline.json)."""
    import torch

    platform = devices.current()
    work.mkdir(parents=True, exist_ok=True)
    shape = SHAPES[mode]
    dtype = "bfloat16" if mode == "gpu" else "float32"
    partial = Partial(work / PARTIAL, {"shape": shape, "dtype": dtype})
    nbytes = 2**30 if mode == "gpu" else 64 * 2**20
    measured = copy_bandwidth(platform.torch_device(), nbytes)
    partial.set(
        "bandwidth",
        {
            "measured_bytes_s": measured,
            "vendor_bytes_s": vendor_bandwidth(platform.device_name()),
            "buffer_bytes": nbytes,
            "device": platform.device_name(),
        },
    )
    checkpoint = work / "roofline-ckpt"
    torch.set_grad_enabled(False)
    try:
        batch1 = in_process(mode, partial, checkpoint)
        try:
            served(mode, partial, checkpoint, work, batch1)
        except Exception as exc:  # reported in its row; the in-process figures stand
            partial.set("served", {"error": f"{type(exc).__name__}: {exc}"[:1500]})
    finally:
        shutil.rmtree(checkpoint, ignore_errors=True)  # 16 GB on a GPU run
    return partial.data
