"""Data-parallel step time and optimizer-state memory per ZeRO stage, against torch's own DDP and
ZeroRedundancyOptimizer, on real gloo processes: `python -m bench.bench_zero [--quick]`.

Each layout trains its own copy of the same Llama-style model (AdamW); the layouts take turns
step by step (so background load hits them alike) and `--steps` steps (forward, backward, clip,
step) are timed after warm-up; the reported time is the slowest rank's median. Rows print ours / baseline as a throughput ratio (> 1: ours faster) and the
per-rank optimizer-state bytes.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

WORLD = 2


def _model(args: argparse.Namespace) -> torch.nn.Module:
    from models import build_model
    from models.registry import get_config

    config = get_config(
        "tiny-llama-gqa",
        hidden_size=args.hidden,
        num_layers=args.layers,
        ffn_hidden_size=4 * args.hidden,
        vocab_size=args.vocab,
        max_position_embeddings=args.seq,
    )
    torch.manual_seed(0)
    model = build_model(config, device=torch.device("cpu"))
    model.init_weights(seed=0)
    return model


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    from torch.distributed.tensor import DTensor

    total = 0
    # ZeroRedundancyOptimizer keeps this rank's partition in its local `optim`.
    local_optimizer = getattr(optimizer, "optim", optimizer)
    for state in local_optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                local = value.to_local() if isinstance(value, DTensor) else value
                total += local.numel() * local.element_size()
    return total


def _build(layout: str, model: torch.nn.Module) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    import torch.distributed as dist

    from parallel.data_parallel import apply_data_parallel, build_dp_mesh, wrap_optimizer

    def adamw(params):
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, foreach=True)

    if layout == "torch DDP":
        return torch.nn.parallel.DistributedDataParallel(model), adamw(model.parameters())
    if layout == "torch ZeroRedundancyOptimizer":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        wrapped = torch.nn.parallel.DistributedDataParallel(model)
        optimizer = ZeroRedundancyOptimizer(
            wrapped.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3, weight_decay=0.1
        )
        return wrapped, optimizer
    stage = int(layout.split("-")[1])
    mesh = build_dp_mesh(dist.get_world_size(), 1, dist.get_world_size())
    model = apply_data_parallel(model, mesh, zero_stage=stage)
    return model, wrap_optimizer(adamw(model.parameters()), model, mesh, zero_stage=stage)


def _run(rank: int, world_size: int, layouts: list[str], args: argparse.Namespace) -> dict:
    from parallel.data_parallel import clip_grad_norm_

    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=generator)
    built = {layout: _build(layout, _model(args)) for layout in layouts}
    times: dict[str, list[float]] = {layout: [] for layout in layouts}
    # Interleave the layouts step by step so that load from other processes hits all alike.
    for step in range(args.warmup + args.steps):
        for layout, (model, optimizer) in built.items():
            start = time.perf_counter()
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, args.vocab), tokens[:, 1:].reshape(-1))
            loss.backward()
            clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            if step >= args.warmup:
                times[layout].append(time.perf_counter() - start)
    results = {
        layout: (statistics.median(times[layout]), _state_bytes(optimizer))
        for layout, (_, optimizer) in built.items()
    }
    return results


def main(argv: list[str] | None = None) -> int:
    """Run every layout on WORLD gloo processes and print times, ratios and state bytes."""
    from tests.harness import run_distributed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller model and fewer steps")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    args.hidden, args.layers, args.vocab, args.seq, args.batch = (
        (64, 2, 512, 64, 4) if args.quick else (256, 4, 4096, 256, 4)
    )
    args.warmup = 2
    if args.quick:
        args.steps = min(args.steps, 8)
    layouts = [
        "torch DDP",
        "torch ZeroRedundancyOptimizer",
        "zero-0",
        "zero-1",
        "zero-2",
        "zero-3",
    ]
    per_rank = run_distributed(_run, WORLD, layouts, args)
    print(
        f"config: DP{WORLD} gloo CPU, llama hidden={args.hidden} layers={args.layers} "
        f"vocab={args.vocab} seq={args.seq} micro-batch={args.batch}/rank, AdamW, "
        f"{args.steps} timed steps (median, slowest rank)"
    )
    step_s = {name: max(r[name][0] for r in per_rank) for name in layouts}
    state = {name: per_rank[0][name][1] for name in layouts}
    baselines = {"zero-0": "torch DDP", "zero-1": "torch ZeroRedundancyOptimizer"}
    print(f"{'layout':32s} {'step ms':>9s} {'state MiB/rank':>15s}  ratio (throughput vs baseline)")
    for name in layouts:
        base = baselines.get(name, "torch DDP" if name.startswith("zero") else None)
        ratio = f"{step_s[base] / step_s[name]:.2f}x vs {base}" if base else "baseline"
        print(f"{name:32s} {step_s[name] * 1e3:9.1f} {state[name] / 2**20:15.2f}  {ratio}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
