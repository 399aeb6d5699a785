"""DP2 under every ZeRO stage (and HSDP, CPU offload) reproduces the single-process run.

Tolerance: fp32 throughout; the only difference from the single process is the order of the
gradient sums (two ranks' halves all-reduced vs one pass), ~1e-7 relative per step, which
Adam carries forward (where a gradient is near Adam's eps a rounding difference moves the update
by a visible fraction of lr). Over 20 steps we allow 1e-5 relative on every loss and 1e-4
absolute (1% of one lr=1e-2 step) on every final parameter. Measured on tiny-llama-gqa (hidden
32, 2 layers): DP2 losses within 1.1e-7 relative and parameters within 5.8e-6 for every stage;
HSDP 2x2 parameters within 2.4e-5. bf16 compute (fp32
master weights, fp32 reduction) is checked loosely: losses within 2e-2 relative (measured 6.4e-3),
parameters within 0.15 (measured 7.5e-2).
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor

from parallel.data_parallel import (
    apply_data_parallel,
    build_dp_mesh,
    clip_grad_norm_,
    wrap_optimizer,
)
from tests.harness import run_distributed
from tests.parallel.test_data_parallel_model import (
    VOCAB,
    build_optimizer,
    build_tiny_model,
    full_parameters,
    global_batch,
    train_steps,
)

STEPS = 20
LOSS_RTOL = 1e-5
PARAM_ATOL = 1e-4
BF16_LOSS_RTOL = 2e-2
BF16_PARAM_ATOL = 0.15

DP2_LAYOUTS = {
    "zero0": dict(zero_stage=0),
    "zero1": dict(zero_stage=1),
    "zero2": dict(zero_stage=2),
    "zero3": dict(zero_stage=3),
    "zero3-offload": dict(zero_stage=3, cpu_offload=True),
    "zero2-bf16": dict(zero_stage=2, param_dtype=torch.bfloat16),
}


def _reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    model = build_tiny_model()
    optimizer = build_optimizer(model)
    losses = train_steps(model, optimizer, range(STEPS))
    return losses, full_parameters(model)


def _train_layouts(
    rank: int, world_size: int, layouts: dict, dp_replicate: int, dp_shard: int
) -> dict:
    results = {}
    for name, options in layouts.items():
        options = dict(options)
        hsdp = options.pop("hsdp", False)
        mesh = build_dp_mesh(world_size, dp_replicate, dp_shard)
        model = apply_data_parallel(build_tiny_model(), mesh, hsdp=hsdp, **options)
        optimizer = wrap_optimizer(
            build_optimizer(model), model, mesh, zero_stage=options["zero_stage"]
        )
        losses = train_steps(model, optimizer, range(STEPS), dp_rank=rank, dp_size=world_size)
        # numpy crosses the result queue by value (tensors would go through shared memory).
        params = {k: v.numpy() for k, v in full_parameters(model).items()}
        results[name] = (losses, params if rank == 0 else None)
    return results


def _assert_matches(name, losses, params, ref_losses, ref_params, loss_rtol, param_atol):
    worst_loss = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True))
    assert worst_loss <= loss_rtol, f"{name}: loss curve off by {worst_loss:.2e} relative"
    assert params.keys() == ref_params.keys()
    worst_param = max(
        (torch.from_numpy(params[k]) - ref_params[k]).abs().max().item() for k in params
    )
    assert worst_param <= param_atol, f"{name}: final parameters off by {worst_param:.2e}"


@pytest.mark.dist
@pytest.mark.slow
def test_dp2_every_zero_stage_matches_single_process():
    ref_losses, ref_params = _reference()
    assert ref_losses[-1] < ref_losses[0] - 0.1, "the reference run must actually learn"
    results = run_distributed(_train_layouts, 2, DP2_LAYOUTS, 1, 2)[0]
    for name, (losses, params) in results.items():
        if name.endswith("bf16"):
            _assert_matches(
                name, losses, params, ref_losses, ref_params, BF16_LOSS_RTOL, BF16_PARAM_ATOL
            )
        else:
            _assert_matches(name, losses, params, ref_losses, ref_params, LOSS_RTOL, PARAM_ATOL)


@pytest.mark.dist
@pytest.mark.slow
def test_hsdp_2x2_matches_single_process():
    ref_losses, ref_params = _reference()
    layouts = {"hsdp-zero3": dict(zero_stage=3, hsdp=True), "ddp4": dict(zero_stage=1)}
    results = run_distributed(_train_layouts, 4, layouts, 2, 2)[0]
    for name, (losses, params) in results.items():
        _assert_matches(name, losses, params, ref_losses, ref_params, LOSS_RTOL, PARAM_ATOL)


def _one_backward(model) -> None:
    tokens = global_batch(0)
    loss = torch.nn.functional.cross_entropy(
        model(tokens[:, :-1]).reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)
    )
    loss.backward()


def _norms_and_state_sizes(rank: int, world_size: int) -> dict:
    out = {}
    for stage in (0, 1, 3):
        mesh = build_dp_mesh(world_size, 1, world_size)
        model = apply_data_parallel(build_tiny_model(), mesh, zero_stage=stage)
        optimizer = wrap_optimizer(build_optimizer(model), model, mesh, zero_stage=stage)
        _one_backward(model)  # every rank sees the same batch: reduced gradient = local one
        norm = clip_grad_norm_(model.parameters(), max_norm=0.0).item()
        optimizer.step()
        state_numel = sum(
            (v.to_local() if isinstance(v, DTensor) else v).numel()
            for s in optimizer.state.values()
            for k, v in s.items()
            if k == "exp_avg"
        )
        out[stage] = (norm, state_numel)
    return out


@pytest.mark.dist
def test_grad_norm_is_global_and_zero1_shards_optimizer_state():
    reference = build_tiny_model()
    _one_backward(reference)
    ref_norm = clip_grad_norm_(reference.parameters(), max_norm=0.0).item()
    total = sum(p.numel() for p in reference.parameters())
    results = run_distributed(_norms_and_state_sizes, 2)
    for stage in (0, 1, 3):
        for rank in range(2):
            norm, _ = results[rank][stage]
            assert abs(norm - ref_norm) <= 1e-6 * ref_norm, (stage, rank, norm, ref_norm)
    assert [results[r][0][1] for r in range(2)] == [total, total]  # DDP: replicated state
    for stage in (1, 3):
        sizes = [results[r][stage][1] for r in range(2)]
        assert sum(sizes) == total and max(sizes) < total, (stage, sizes)


def test_clip_grad_norm_clips_to_max_norm():
    model = build_tiny_model()
    _one_backward(model)
    before = clip_grad_norm_(model.parameters(), max_norm=0.5)
    after = clip_grad_norm_(model.parameters(), max_norm=0.0)
    assert before > 0.5 and abs(after.item() - 0.5) < 1e-5


def test_clip_also_is_clipped_alike_but_left_out_of_the_norm():
    # A pipeline's tied head copy: its gradient equals the embedding's, counted once in the norm,
    # yet it must be scaled by the same coefficient or it steps differently from the embedding.
    embedding = torch.nn.Parameter(torch.zeros(3))
    copy = torch.nn.Parameter(torch.zeros(3))
    embedding.grad, copy.grad = torch.tensor([3.0, 4.0, 0.0]), torch.tensor([3.0, 4.0, 0.0])
    total = clip_grad_norm_([embedding], max_norm=1.0, clip_also=[copy])
    assert abs(total.item() - 5.0) < 1e-6
    expected = torch.tensor([0.6, 0.8, 0.0])
    assert torch.allclose(embedding.grad, expected, atol=1e-6)
    assert torch.allclose(copy.grad, expected, atol=1e-6)


@pytest.mark.parametrize(
    ("sizes", "message"),
    [((4, 3, 2), "must equal the data-parallel world size 4"), ((4, -1, -1), "cannot both be -1")],
)
def test_bad_mesh_sizes_are_rejected(sizes, message):
    with pytest.raises(ValueError, match=message):
        build_dp_mesh(*sizes)
