"""The measuring side of `make device-check` (bench/device_check.py runs each in a child process).

`train_worker`: one training side (HF + torch fused AdamW, Meshline eager, Meshline `--compile`)
on the ~1.2B Llama shape, tokens/s, TFLOP/s, MFU and peak memory, optionally one profiled step.
`decode_worker`: greedy decode, batch 1 and 8, Meshline's engine (CUDA graphs on a GPU, and
eagerly for comparison) against HF `generate`, parity checked in fp32. `kernels_worker`: each
kernel's default backend against HF/torch eager (bench.bench_kernels). `SHAPES` holds the GPU
shapes and the CPU smoke shapes.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

from kernels import device, peak_flops

SHAPES: dict[str, dict[str, int]] = {
    "gpu": dict(
        hidden=2048, layers=16, heads=16, kv=8, ffn=5632, vocab=32000, seq=2048, mbs=2, gbs=16,
        warmup=2, steps=4, prompt=128, new=128,
    ),
    "smoke": dict(
        hidden=64, layers=2, heads=4, kv=2, ffn=128, vocab=256, seq=64, mbs=2, gbs=4,
        warmup=1, steps=2, prompt=8, new=8,
    ),
}  # fmt: skip


def train_flags(shape: dict[str, int], bf16: bool, compile_layers: bool) -> list[str]:
    flags = [
        "--model", "tiny-llama", "--num-layers", str(shape["layers"]),
        "--hidden-size", str(shape["hidden"]), "--num-attention-heads", str(shape["heads"]),
        "--num-query-groups", str(shape["kv"]), "--ffn-hidden-size", str(shape["ffn"]),
        "--vocab-size", str(shape["vocab"]), "--max-position-embeddings", str(shape["seq"]),
        "--seq-length", str(shape["seq"]), "--micro-batch-size", str(shape["mbs"]),
        "--global-batch-size", str(shape["gbs"]),
        "--mock-data", "--train-iters", str(shape["warmup"] + shape["steps"]), "--lr", "1e-4",
        "--lr-decay-style", "constant", "--weight-decay", "0.1", "--clip-grad", "1.0",
        "--eval-interval", "0", "--optimizer", "fused_adam", "--log-interval", "1000",
    ]  # fmt: skip
    if bf16:
        flags.append("--bf16")
    if compile_layers:
        flags.append("--compile")
    return flags


def _hf_train_step(config: Any, bf16: bool) -> Any:
    """HF LlamaForCausalLM on the same batches, torch fused AdamW, same clipping."""
    from transformers import LlamaConfig, LlamaForCausalLM

    # this worker's stack only: every device-check child imports this module
    from models.hf_adapters import hf_config
    from training.batching import MicroBatchStream
    from training.setup import build_data, build_model_config

    (train, _), _, _ = build_data(config, dp_size=1)
    target = device.current().torch_device()
    hf = LlamaForCausalLM._from_config(
        LlamaConfig(**hf_config(build_model_config(config))), attn_implementation="sdpa"
    ).to(target)
    if bf16:
        hf = hf.to(torch.bfloat16)
    stream = MicroBatchStream(
        train, consumed_samples=0, micro_batch_size=config.batch.micro_batch_size,
        dp_rank=0, dp_size=1,
    )  # fmt: skip
    decay = [p for p in hf.parameters() if p.ndim >= 2]
    no_decay = [p for p in hf.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=1e-4,
        fused=True,
    )

    n_micro = config.batch.global_batch_size // config.batch.micro_batch_size

    def step() -> None:
        for _ in range(n_micro):  # gradient accumulation, as the trainer does for the same sizes
            batch = {k: v.to(target) for k, v in stream.next().items()}
            out = hf(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
            loss = torch.nn.functional.cross_entropy(
                out.logits.flatten(0, 1).float(), batch["labels"].flatten()
            )
            (loss / n_micro).backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def train_worker(
    side: str, shape: dict[str, int], bf16: bool, profile_dir: Path | None = None
) -> dict[str, Any]:
    """One training side in this process: tokens/s, TFLOP/s, MFU, peak memory, compile time.

    With `profile_dir`, one more step runs under torch.profiler and its operator table (sorted by
    device time) is written to `profile-<side>.txt` there: where a step's time goes, from the
    same run that measured it.
    """
    from torch._dynamo.utils import counters

    # this worker's stack only: every device-check child imports this module
    from models.accounting import flops_per_token
    from services.trainer.arguments import parse_args
    from training.loop import Trainer
    from training.setup import build_model_config

    torch.manual_seed(0)
    config = parse_args(train_flags(shape, bf16, compile_layers=side == "ours-compile"))
    step = Trainer(config).train_step if side.startswith("ours") else _hf_train_step(config, bf16)
    start = time.perf_counter()
    for _ in range(shape["warmup"]):
        step()
    device.synchronize()
    warmup_s = time.perf_counter() - start
    device.reset_peak_memory_stats()
    begin = time.perf_counter()
    for _ in range(shape["steps"]):
        step()
    device.synchronize()
    elapsed = time.perf_counter() - begin
    tokens_per_s = shape["gbs"] * shape["seq"] * shape["steps"] / elapsed
    tflops = tokens_per_s * flops_per_token(build_model_config(config), shape["seq"]) / 1e12
    peak = peak_flops.peak_tflops()
    result = {
        "side": side,
        "tokens_per_s": tokens_per_s,
        "tflops": tflops,
        "mfu": tflops / peak.tflops,
        "peak_memory_gib": device.memory_stats().peak / 2**30,
        "warmup_s": warmup_s,
        "graph_breaks": sum(counters["graph_break"].values()),
    }
    if profile_dir is not None:
        _profile_step(step, profile_dir / f"profile-{side}.txt")
    return result


def _profile_step(step: Any, path: Path) -> None:
    """One step under torch.profiler; the operator table sorted by device (else CPU) time."""
    from torch.profiler import ProfilerActivity, profile

    on_cuda = device.current().type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    begin = time.perf_counter()
    with profile(activities=activities) as prof:
        step()
        device.synchronize()
    wall = time.perf_counter() - begin
    key = "self_cuda_time_total" if on_cuda else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=40, max_name_column_width=60)
    path.write_text(f"one profiled step: {wall * 1e3:.1f} ms wall (profiler on)\n{table}\n")


class _DecodeSides:
    """HF's model and Meshline's two engines (CUDA graphs as served, and eager) on the same
    weights, each run greedily for the shape's new tokens."""

    def __init__(self, hf: Any, config: Any, target: Any, shape: dict[str, int]) -> None:
        self.hf, self.config, self.target, self.shape = hf, config, target, shape
        self.engine: Any = None
        self.eager: Any = None

    def load(self, dtype: torch.dtype) -> None:
        """HF in `dtype`, and both engines built from its weights."""
        # this worker's stack only: every device-check child imports this module
        from engine.engine import Engine, EngineConfig
        from engine.tokens import TokenizerInfo
        from models import build_model
        from models.hf_adapters import from_hf

        config = self.config
        self.hf = self.hf.to(dtype=dtype)
        ours = build_model(config, device=self.target, dtype=dtype).eval()
        ours.load_state_dict(from_hf(self.hf.state_dict(), config))
        tokens = TokenizerInfo(config.vocab_size)
        self.engine = Engine(ours, tokens, EngineConfig(max_batch_rows=8))
        # A copy whose every step launches eagerly (diagnosis: what CUDA graphs gain); its own
        # model, since an engine may repack its model's CPU linear layers.
        twin = build_model(config, device=self.target, dtype=dtype).eval()
        twin.load_state_dict(from_hf(self.hf.state_dict(), config))
        self.eager = Engine(twin, tokens, EngineConfig(max_batch_rows=8, enforce_eager=True))

    def hf_run(self, batch: list[list[int]]) -> list[list[int]]:
        ids = torch.tensor(batch, device=self.target)
        with torch.inference_mode():
            out = self.hf.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=self.shape["new"],
                do_sample=False, eos_token_id=None, pad_token_id=0,
                top_k=None, top_p=None, temperature=None,
            )  # fmt: skip
        return out[:, self.shape["prompt"] :].tolist()

    def ours_run(self, batch: list[list[int]], which: Any = None) -> list[list[int]]:
        from engine.sampling import SamplingConfig  # the worker's own stack (see load)

        run = which or self.engine
        assert run is not None
        settings = [SamplingConfig(max_new_tokens=self.shape["new"]) for _ in batch]
        return [r[0].token_ids for r in run.generate(batch, settings)]

    def eager_run(self, batch: list[list[int]]) -> list[list[int]]:
        return self.ours_run(batch, self.eager)


def _random_hf_llama(shape: dict[str, int], target: Any) -> tuple[Any, Any]:
    """Meshline's config of the decode shape and an HF Llama of it with N(0, 0.02) weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    # the worker's own stack (see _DecodeSides.load)
    from models.hf_adapters import hf_config
    from models.registry import get_config

    config = get_config(
        "tiny-llama-gqa", vocab_size=shape["vocab"], hidden_size=shape["hidden"],
        num_layers=shape["layers"], num_attention_heads=shape["heads"], num_kv_heads=shape["kv"],
        ffn_hidden_size=shape["ffn"], max_position_embeddings=shape["prompt"] + shape["new"] + 8,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = LlamaForCausalLM._from_config(LlamaConfig(**hf_config(config)), attn_implementation="sdpa")
    with torch.no_grad():
        for param in hf.parameters():
            param.normal_(0, 0.02)
    return config, hf.to(device=target).eval()


def _decode_parity(
    sides: _DecodeSides, prompts: list[list[int]], dtype: torch.dtype
) -> dict[str, Any]:
    """Greedy tokens identical to HF's in fp32, then (loaded in `dtype`) the shared prefix."""
    # Parity in fp32 with TF32 off (random weights give near-flat logits, where bf16 rounding
    # alone flips an argmax); then the timed runs in the benchmark dtype, whose greedy tokens are
    # reported as the length of the prefix shared with HF.
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    sides.load(torch.float32)
    result: dict[str, Any] = {
        "identical_greedy": sides.ours_run(prompts[:2]) == sides.hf_run(prompts[:2])
    }
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    sides.load(dtype)
    if dtype != torch.float32:
        mine, theirs = sides.ours_run(prompts[:1])[0], sides.hf_run(prompts[:1])[0]
        shared = next(
            (i for i, (a, b) in enumerate(zip(mine, theirs, strict=True)) if a != b), len(mine)
        )
        result[f"shared_prefix_{str(dtype).removeprefix('torch.')}"] = shared
    return result


def _decode_rates(sides: _DecodeSides, batch: list[list[int]]) -> dict[str, float]:
    """Tokens/s of each side on `batch`: the best of three interleaved rounds."""
    times: dict[str, list[float]] = {"hf": [], "ours": [], "ours_eager": []}
    runs = (("hf", sides.hf_run), ("ours", sides.ours_run), ("ours_eager", sides.eager_run))
    for _ in range(3):
        for name, fn in runs:
            device.synchronize()
            begin = time.perf_counter()
            fn(batch)
            device.synchronize()
            times[name].append(time.perf_counter() - begin)
    tokens = len(batch) * sides.shape["new"]
    return {f"{name}_tokens_per_s": tokens / min(t) for name, t in times.items()}


def decode_worker(shape: dict[str, int], bf16: bool) -> dict[str, Any]:
    """Greedy decode, batch 1 and 8: Meshline's engine vs HF generate on the same weights."""
    dtype = torch.bfloat16 if bf16 else torch.float32
    target = device.current().torch_device()
    config, hf = _random_hf_llama(shape, target)
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(4, config.vocab_size, (8, shape["prompt"]), generator=gen).tolist()
    sides = _DecodeSides(hf, config, target, shape)
    result = _decode_parity(sides, prompts, dtype)
    for rows in (1, 8):
        result[f"batch{rows}"] = _decode_rates(sides, prompts[:rows])
    return result


KERNEL_SHAPES = {
    "gpu": dict(batch=2, seq=2048, heads=16, kv_heads=8, head_dim=128, ffn=5632, vocab=32000),
    "smoke": dict(batch=1, seq=64, heads=4, kv_heads=2, head_dim=16, ffn=64, vocab=256),
}


def kernels_worker(mode: str, bf16: bool) -> dict[str, Any]:
    """Each kernel's default backend on this device (on CUDA: the torch.compile-generated ones)
    against HF's / torch's eager equivalent, forward+backward, via bench.bench_kernels."""
    from bench import bench_kernels  # the kernels worker's stack only

    torch.set_default_device(device.current().torch_device())
    torch.manual_seed(0)
    args = argparse.Namespace(**KERNEL_SHAPES[mode])
    dtype = torch.bfloat16 if bf16 else torch.float32
    table = bench_kernels.Table(
        min_run_time=0.05 if mode == "gpu" else 0.005, rounds=2 if mode == "gpu" else 1
    )
    bench_kernels.bench_norm_rotary_activation(table, args, dtype)
    bench_kernels.bench_attention(table, args, dtype)
    bench_kernels.bench_cross_entropy(table, args, dtype)
    rows = [
        {"op": op, "impl": impl, "ms": t * 1e3, "baseline": base, "speedup": speedup}
        for op, impl, t, base, speedup in table.rows
    ]
    return {"dtype": str(dtype).removeprefix("torch."), "rows": rows}
