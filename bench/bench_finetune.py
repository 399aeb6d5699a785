"""LoRA vs full fine-tuning, and Meshline LoRA vs peft on HF: `python -m bench.bench_finetune`.

Four trainers of the same Llama-style network (same weights, AdamW, fp32) take turns step by
step, so background load hits them alike: Meshline full fine-tuning, Meshline LoRA, HF
`LlamaForCausalLM` full fine-tuning and HF + peft LoRA (same rank, alpha and target layers:
q, k, v, o, gate, up, down; Meshline's model is built unfused so the adapters have identical
shapes, `--fused` measures the fused layout). Each row prints trainable parameters, training memory (parameters +
gradients + optimizer state + tensors saved for backward, measured with saved-tensor hooks, so
it is exact and independent of the allocator) and tokens/s (median step over `--steps` timed
steps after warm-up). Ratios: Meshline LoRA / Meshline full, and Meshline LoRA / peft LoRA
(tokens/s > 1: ours faster; memory < 1: ours smaller).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from kernels import device
from kernels.cross_entropy import cross_entropy
from models import build_model
from models.hf_adapters import hf_config, to_hf
from models.lora import LoraConfig, apply_lora
from models.registry import get_config


def _config(args: argparse.Namespace) -> Any:
    return get_config(
        "tiny-llama",
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_attention_heads=args.hidden // 64 if args.hidden >= 128 else 2,
        ffn_hidden_size=int(args.hidden * 8 / 3) // 8 * 8,
        vocab_size=args.vocab,
        max_position_embeddings=args.seq,
        fused_qkv=args.fused,
        fused_gate_up=args.fused,
    )


def _meshline(config: Any, lora: bool, r: int, dev: torch.device) -> torch.nn.Module:
    model = build_model(config, device="meta")
    model.to_empty(device=dev)
    model.init_weights(seed=0)
    if lora:
        targets = ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"]
        apply_lora(model, LoraConfig(r=r, alpha=2.0 * r, target_modules=targets), seed=0)
    return model


def _hf(config: Any, lora: bool, r: int, dev: torch.device) -> torch.nn.Module:
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = LlamaForCausalLM._from_config(
        LlamaConfig(**hf_config(config)), attn_implementation="sdpa"
    ).to(dev)
    hf.load_state_dict(to_hf(_meshline(config, False, r, dev).state_dict(), config), strict=False)
    if lora:
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        hf = get_peft_model(hf, PeftLoraConfig(r=r, lora_alpha=2 * r, target_modules=targets))
    return hf


class Run:
    """One trainer: model, AdamW over its trainable parameters, and a step function."""

    def __init__(self, name: str, model: torch.nn.Module, hf: bool) -> None:
        self.name, self.model, self.hf = name, model.train(), hf
        params = [p for p in model.parameters() if p.requires_grad]
        self.trainable = sum(p.numel() for p in params)
        self.optimizer = torch.optim.AdamW(params, lr=1e-4, foreach=True)
        self.times: list[float] = []
        self.memory = 0

    def loss(self, ids: torch.Tensor) -> torch.Tensor:
        logits = self.model(input_ids=ids[:, :-1]).logits if self.hf else self.model(ids[:, :-1])
        return cross_entropy(logits, ids[:, 1:])

    def step(self, ids: torch.Tensor, platform: Any, timed: bool) -> None:
        saved: list[int] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            saved.append(t.numel() * t.element_size())
            return t

        start = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = self.loss(ids)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        platform.synchronize()
        if timed:
            self.times.append(time.perf_counter() - start)
        self.memory = max(self.memory, sum(saved) + self._state_bytes())

    def _state_bytes(self) -> int:
        seen = {id(p): p for p in self.model.parameters()}
        params = sum(p.numel() * p.element_size() for p in seen.values())
        grads = sum(p.numel() * p.element_size() for p in seen.values() if p.requires_grad)
        states = sum(
            v.numel() * v.element_size()
            for s in self.optimizer.state.values()
            for v in s.values()
            if isinstance(v, torch.Tensor) and v.dim() > 0
        )
        return params + grads + states


def _fmt_row(run: Run, tokens: int) -> str:
    tps = tokens / statistics.median(run.times)
    return (
        f"{run.name:<18} trainable {run.trainable:>11,}  memory {run.memory / 2**20:8.1f} MiB  "
        f"tokens/s {tps:10,.0f}"
    )


def main(argv: list[str] | None = None) -> int:
    """Run the comparison and print one row per trainer plus the ratios."""
    parser = argparse.ArgumentParser(prog="python -m bench.bench_finetune")
    parser.add_argument("--quick", action="store_true", help="small model, few steps")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--steps", type=int, default=None, help="timed steps (8; --quick: 4)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--fused",
        action="store_true",
        help="fused qkv / gate_up projections (one LoRA A per fused layer, fewer adapter "
        "parameters than peft's per-projection adapters); default: separate, as peft",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.hidden, args.layers, args.vocab, args.seq = 256, 2, 4096, 256
    if args.steps is None:
        args.steps = 4 if args.quick else 8
    platform = device.current()
    dev = platform.torch_device()
    config = _config(args)
    builders: dict[str, Callable[[], torch.nn.Module]] = {
        "meshline full": lambda: _meshline(config, False, args.rank, dev),
        "meshline lora": lambda: _meshline(config, True, args.rank, dev),
        "hf full": lambda: _hf(config, False, args.rank, dev),
        "hf+peft lora": lambda: _hf(config, True, args.rank, dev),
    }
    runs = [Run(name, build(), name.startswith("hf")) for name, build in builders.items()]
    gen = torch.Generator().manual_seed(0)
    tokens = args.batch * args.seq
    for i in range(args.warmup + args.steps):
        ids = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen).to(dev)
        for run in runs:
            run.step(ids, platform, timed=i >= args.warmup)
    print(
        f"bench_finetune: {platform.type}, hidden {args.hidden}, layers {args.layers}, "
        f"heads {config.num_attention_heads}, ffn {config.ffn_hidden_size}, vocab {args.vocab}, "
        f"batch {args.batch} x seq {args.seq}, LoRA r={args.rank} alpha={2 * args.rank} on all "
        f"attention and MLP linears, AdamW fp32, {args.steps} timed steps, "
        f"{'fused' if args.fused else 'separate'} projections"
    )
    for run in runs:
        print(_fmt_row(run, tokens))
    by = {run.name: run for run in runs}

    def tps(name: str) -> float:
        return tokens / statistics.median(by[name].times)

    ours, full, peft = by["meshline lora"], by["meshline full"], by["hf+peft lora"]
    print(
        f"meshline lora / meshline full: trainable {ours.trainable / full.trainable:.4f}, "
        f"memory {ours.memory / full.memory:.3f}, tokens/s {tps('meshline lora') / tps('meshline full'):.2f}"
    )
    print(
        f"meshline lora / hf+peft lora: trainable {ours.trainable / peft.trainable:.3f}, "
        f"memory {ours.memory / peft.memory:.3f}, tokens/s {tps('meshline lora') / tps('hf+peft lora'):.2f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
