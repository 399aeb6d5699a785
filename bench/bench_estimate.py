"""`meshline estimate` against measured memory of real training steps (one process, CPU).

    python -m bench.bench_estimate [--quick]

For each model and run shape: the estimate's activations against the bytes autograd saves for
backward (distinct non-parameter storages, `saved_tensors_hooks`), and its total against the
measured peak of a steady-state AdamW step (allocator events of `torch.profiler`, accumulated in
time order, plus the states alive before the step). Prints measured / estimated (1.00 = exact).
The model states themselves are exact by construction and checked against the dry run in
tests/models/test_estimate_vs_dry_run.py.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from models import build_model
from models.memory import TrainingLayout, estimate
from models.registry import get_config

SHAPES = [("tiny-llama", 4, 64), ("tiny-llama-gqa", 4, 128), ("tiny-bloom", 2, 128)]


def measure(name: str, batch: int, seq: int, layers: int) -> tuple[int, int, int, int]:
    """(saved activation bytes, estimated activations, measured peak, estimated total)."""
    torch.manual_seed(0)
    config = get_config(name, num_layers=layers)
    model = build_model(config, device="cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    ids = torch.randint(0, config.vocab_size, (batch, seq))
    row = estimate(config, TrainingLayout(micro_batch_size=batch, seq_length=seq))[0]
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    def step() -> None:
        logits = model(ids)
        F.cross_entropy(logits.view(-1, config.vocab_size), ids.view(-1)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(ids)
    activations = sum(saved.values()) + logits.numel() * logits.element_size()
    del logits
    step()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    current = peak = 0
    for event in sorted(
        (e for e in prof.events() if e.self_cpu_memory_usage), key=lambda e: e.time_range.start
    ):
        current += event.self_cpu_memory_usage
        peak = max(peak, current)
    states = sum(p.numel() * 4 for p in model.parameters()) + sum(
        t.numel() * t.element_size()
        for s in opt.state.values()
        for k, t in s.items()
        if k != "step"
    )
    return activations, row.activations, states + peak, row.total


def main(argv: list[str] | None = None) -> int:
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 layers instead of 4")
    args = parser.parse_args(argv)
    layers = 2 if args.quick else 4
    print(f"{'model':<16}{'b x s':>9}{'activ meas/est':>16}{'peak meas/est':>15}")
    for name, batch, seq in SHAPES:
        act, act_est, peak, total = measure(name, batch, seq, layers)
        print(f"{name:<16}{f'{batch}x{seq}':>9}{act / act_est:>16.2f}{peak / total:>15.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
