"""Data-parallel step time and optimizer-state memory per ZeRO stage, against torch's own DDP and
ZeroRedundancyOptimizer, on real gloo processes: `python -m bench.bench_zero [--quick]`.

`--adam`: the offloaded optimizer's CPU step (`parallel.offload_optimizer.OffloadAdamW`, cpu and
nvme tiers) against `torch.optim.AdamW` foreach and fused on the same fp32 parameters.

`--ladder`: the memory ladder (ZeRO-2 -> + optimizer offload -> ZeRO-3 -> + parameter offload ->
+ NVMe optimizer tier), each rung in fresh gloo processes training the same model `--steps`
steps through `training.loop.Trainer`: peak resident set per rank (VmHWM) and the resident set
after the steps (VmRSS; the drop rung to rung is taken on it, the peak being dominated by
transient buffers whose size varies run to run), the bytes the rung
moves off the "device" (on a CPU run the device is the host, so only the NVMe tier and sharding
take bytes out of the process), and the largest loss difference from the ZeRO-2 run.

Each layout trains its own copy of the same Llama-style model (AdamW); the layouts take turns
step by step (so background load hits them alike) and `--steps` steps (forward, backward, clip,
step) are timed after warm-up; the reported time is the slowest rank's median. Rows print ours / baseline as a throughput ratio (> 1: ours faster) and the
per-rank optimizer-state bytes.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch
import torch.nn.functional as F

WORLD = 2


def _model(args: argparse.Namespace) -> torch.nn.Module:
    # in the spawned rank, after run_distributed has set its environment
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

    # in the spawned rank, after run_distributed has set its environment
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
    # in the spawned rank, after run_distributed has set its environment
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


def _adam_bench(args: argparse.Namespace) -> None:
    """Median step time of each AdamW over the same parameters and gradients (one process)."""
    import tempfile

    # not at the top: the spawned ranks import this module, and their peak memory is measured
    from checkpoints.safe_fs import open_dir_beneath
    from parallel.offload_optimizer import OffloadAdamW, OptimizerOffload

    torch.set_num_threads(args.threads)
    shapes = [(args.adam_numel // 64,)] * 64
    hyper = dict(lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    swap = tempfile.mkdtemp(prefix="bench_zero_swap_")

    def offload(device: str):
        def build(params):
            tier = OptimizerOffload(device, nvme_path=swap if device == "nvme" else None)
            folder = open_dir_beneath(swap, roots=(), create=True) if device == "nvme" else None
            return OffloadAdamW(params, offload=tier, swap_dir=folder, **hyper)

        return build

    makers = {
        "torch AdamW foreach": lambda p: torch.optim.AdamW(p, foreach=True, **hyper),
        "torch AdamW fused": lambda p: torch.optim.AdamW(p, fused=True, **hyper),
        "OffloadAdamW cpu": offload("cpu"),
        "OffloadAdamW nvme": offload("nvme"),
    }
    built = {}
    for name, make in makers.items():
        params = [torch.nn.Parameter(torch.randn(shape)) for shape in shapes]
        for param in params:
            param.grad = torch.randn(param.shape) * 1e-3
        built[name] = make(params)
    times: dict[str, list[float]] = {name: [] for name in makers}
    for step in range(args.warmup + args.steps):
        for name, optimizer in built.items():  # interleaved: load hits all alike
            start = time.perf_counter()
            optimizer.step()
            if step >= args.warmup:
                times[name].append(time.perf_counter() - start)
    base = statistics.median(times["torch AdamW foreach"])
    print(
        f"AdamW step over {args.adam_numel / 1e6:.1f}M fp32 parameters in 64 tensors, "
        f"{args.threads} thread(s), {args.steps} steps (median)"
    )
    print(f"{'optimizer':24s} {'step ms':>9s}  ratio (throughput vs torch foreach)")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:24s} {median * 1e3:9.1f}  {base / median:.2f}x")


LADDER = {
    "zero-2": ["--zero-stage", "2"],
    "zero-2 + optimizer offload (cpu)": ["--zero-stage", "2", "--optimizer-cpu-offload"],
    "zero-3": ["--zero-stage", "3"],
    "zero-3 + parameter offload (cpu)": ["--zero-stage", "3", "--cpu-offload"],
    "zero-3 + parameter offload + NVMe optimizer": [
        "--zero-stage", "3", "--cpu-offload", "--optimizer-cpu-offload", "--optimizer-nvme-path",
    ],
}  # fmt: skip


def status_bytes(key: str) -> int:
    """A size field of /proc/self/status (VmHWM: peak resident set, VmRSS: resident set now)."""
    from pathlib import Path

    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def _ladder_rank(rank: int, world_size: int, flags: list[str], args: argparse.Namespace) -> dict:
    from torch.distributed.tensor import DTensor

    # in the spawned rank, after run_distributed has set its environment
    from services.trainer.arguments import parse_args
    from training.loop import Trainer

    torch.set_num_threads(1)
    base = ["--model", "tiny-llama-gqa", "--num-layers", str(args.layers),
            "--hidden-size", str(args.hidden), "--ffn-hidden-size", str(4 * args.hidden),
            "--num-attention-heads", "8", "--num-query-groups", "4",
            "--vocab-size", str(args.vocab), "--mock-data", "--seq-length", str(args.seq),
            "--micro-batch-size", "2", "--global-batch-size", str(2 * world_size),
            "--eval-interval", "0", "--lr", "1e-3", "--log-interval", "1000",
            "--train-iters", str(args.steps)]  # fmt: skip
    trainer = Trainer(parse_args([*base, *flags]))
    losses = [trainer.train_step().loss for _ in range(args.steps)]
    local = sum(
        (p.to_local() if isinstance(p, DTensor) else p).numel() for p in trainer.model.parameters()
    )
    gc.collect()
    return {
        "losses": losses,
        "peak_rss": status_bytes("VmHWM"),
        "rss": status_bytes("VmRSS"),
        "local_params": local,
    }


def _ladder(args: argparse.Namespace) -> None:
    """Each rung in fresh processes (VmHWM is per process); rows against the ZeRO-2 rung."""
    import tempfile

    from tests.harness import run_distributed

    swap = tempfile.mkdtemp(prefix="bench_zero_nvme_")
    rows = {}
    for name, flags in LADDER.items():
        flags = [*flags, swap] if flags[-1] == "--optimizer-nvme-path" else flags
        rows[name] = run_distributed(_ladder_rank, WORLD, flags, args)
    print(
        f"config: DP{WORLD} gloo CPU (the device is the host), llama hidden={args.hidden} "
        f"layers={args.layers} vocab={args.vocab} seq={args.seq}, AdamW fp32, {args.steps} steps"
    )
    first = rows["zero-2"]
    local_params = first[0]["local_params"]
    print(
        f"parameters held per rank (FSDP2 shards under ZeRO-2 and 3): {local_params / 1e6:.2f}M "
        f"({local_params * 4 / 2**20:.1f} MiB fp32)"
    )
    print(
        f"{'rung':45s} {'peak RSS':>9s} {'RSS after':>10s} {'drop vs previous':>17s} "
        f"{'moved off':>10s}  max |loss - ZeRO-2 loss| (relative)   (MiB per rank)"
    )
    previous = None
    for name, ranks in rows.items():
        peak = max(r["peak_rss"] for r in ranks)
        after = max(r["rss"] for r in ranks)
        local = max(r["local_params"] for r in ranks)
        # What leaves the process's memory on a CPU run (the device is the host): the NVMe
        # tier's m and v, 8 bytes a local parameter element.
        moved = 8 * local if "NVMe" in name else 0
        pairs = [
            (a, b)
            for r, f in zip(ranks, first, strict=True)
            for a, b in zip(r["losses"], f["losses"], strict=True)
        ]
        diff = max(abs(a - b) for a, b in pairs)
        rel = max(abs(a - b) / abs(b) for a, b in pairs)
        drop = "" if previous is None else f"{(previous - after) / 2**20:.1f}"
        print(
            f"{name:45s} {peak / 2**20:9.1f} {after / 2**20:10.1f} {drop:>17s} "
            f"{moved / 2**20:10.1f}  {diff:.2e} ({rel:.1e})"
        )
        previous = after


def main(argv: list[str] | None = None) -> int:
    """Run every layout on WORLD gloo processes and print times, ratios and state bytes."""
    from tests.harness import run_distributed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller model and fewer steps")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--adam", action="store_true", help="time the CPU AdamW step only")
    parser.add_argument("--adam-numel", type=int, default=1 << 24)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--ladder", action="store_true", help="the offload memory ladder")
    args = parser.parse_args(argv)
    if args.adam:
        args.warmup = 2
        _adam_bench(args)
        return 0
    if args.ladder:
        args.hidden, args.layers, args.vocab, args.seq = (
            (64, 2, 512, 32) if args.quick else (512, 8, 32768, 32)
        )
        _ladder(args)
        return 0
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
