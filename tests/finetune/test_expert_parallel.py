"""Expert parallelism on real gloo processes: EP2 (all-to-all dispatch, experts split over two
ranks, each rank with half of the batch) trains exactly like EP1 on the whole batch.

Tolerance: losses within 1e-5 per step, expert and replicated weights within 1e-5 after the run
(fp32; differences come only from summation order)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor

from kernels.cross_entropy import cross_entropy
from models import build_model
from models.registry import get_config
from tests.harness import run_distributed

STEPS = 4
MOE = {"num_experts": 4, "top_k": 2}


def _data() -> torch.Tensor:
    return torch.randint(0, 256, (4, 25), generator=torch.Generator().manual_seed(7))


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(get_config("tiny-mixtral", moe=MOE), device="cpu").train()


def _train(model, rows, tokens_total, step_hook):
    """SGD steps on `rows` with the loss normalised by the global token count."""
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(STEPS):
        loss = cross_entropy(model(rows[:, :-1]), rows[:, 1:], reduction="sum") / tokens_total
        opt.zero_grad()
        loss.backward()
        losses.append(step_hook(loss.detach()))
        opt.step()
    return losses


def _ep_body(rank, world_size):
    import torch.distributed as dist

    from parallel.expert_parallel import (
        all_reduce_replicated_grads,
        apply_expert_parallel,
    )

    mesh = torch.distributed.device_mesh.init_device_mesh(
        "cpu", (world_size,), mesh_dim_names=("ep",)
    )
    group = mesh["ep"].get_group()
    model = _model()
    sharded = apply_expert_parallel(model, mesh["ep"])
    data = _data()
    per = data.shape[0] // world_size
    rows = data[rank * per : (rank + 1) * per]

    def hook(loss):
        all_reduce_replicated_grads(model, group)
        total = loss.clone()
        dist.all_reduce(total, group=group)
        return total.item()

    losses = _train(model, rows, data[:, 1:].numel(), hook)
    # Expert weights are Shard(0) DTensors: compare this rank's block.
    state = {
        n: (p.to_local() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in model.named_parameters()
    }
    return losses, state, sharded


@pytest.mark.dist
@pytest.mark.slow
def test_ep2_equals_ep1():
    reference = _model()
    data = _data()
    ref_losses = _train(reference, data, data[:, 1:].numel(), lambda loss: loss.item())
    ref_state = dict(reference.named_parameters())
    results = run_distributed(_ep_body, 2)
    for rank, (losses, state, sharded) in enumerate(results):
        assert len(sharded) == 4  # 2 layers x (gate_up_proj, down_proj)
        for a, b in zip(losses, ref_losses, strict=True):
            assert abs(a - b) <= 1e-5, (rank, losses, ref_losses)
        for name, value in state.items():
            expected = ref_state[name].detach()
            if name in sharded:
                expected = expected[rank * 2 : (rank + 1) * 2]
            torch.testing.assert_close(value, expected, atol=1e-5, rtol=1e-5, msg=name)
    assert ref_losses[-1] < ref_losses[0]


# ---------------------------------------------------------------- through the trainer

TRAINER_STEPS = 6
# Both auxiliary losses are on. Their statistics are per micro-batch and every layout cuts a step
# into the same micro-batches (rows), so they equal one process's; context-parallel ranks see
# sequence chunks and sum their statistics over the cp group (`apply_moe_context_parallel`).
MIXTRAL = ["--model", "tiny-mixtral", "--num-layers", "2", "--moe-z-loss-coeff", "0.05",
           "--moe-aux-loss-coeff", "0.01"]  # fmt: skip
# Validation reads this many micro-batches in all, split over the data-parallel ranks.
VALID_MICRO_BATCHES = 4


def _run_moe(flags, save=None):
    """One layout: (results, trainer). Results: loss curve, final (gathered) weights, validation
    loss, and the auxiliary loss of each MoE layer this rank holds from the step's last
    micro-batch (only on the last data-parallel rank, which runs the micro-batch one process
    runs last). With `save`, a checkpoint of step 2 is written there."""
    from models.moe import moe_layers
    from services.trainer.arguments import parse_args
    from tests.parallel.parity import BASE, full_parameters
    from training.loop import Trainer

    save_flags = ["--save", save] if save else []
    trainer = Trainer(
        parse_args([*BASE, "--train-iters", str(TRAINER_STEPS), *MIXTRAL, *flags, *save_flags])
    )
    losses = []
    for step in range(TRAINER_STEPS):
        losses.append(trainer.train_step().loss)
        if save and step == 1:
            trainer.save()
            trainer.checkpoints.wait()
    last = trainer.dp_rank == trainer.dp_size - 1
    aux = {n: float(m.last_aux_loss) for n, m in moe_layers(trainer.model)} if last else {}
    trainer.config.run.eval_iters = VALID_MICRO_BATCHES // trainer.dp_size
    results = {
        "losses": losses,
        "params": full_parameters(trainer.model),
        "aux": aux,
        "valid": trainer.evaluate(),
    }
    return results, trainer


def _trainer_layouts(rank, world_size, layouts, save=None):
    """Every layout's results; with `save`, the first layout writes its step-2 checkpoint."""
    first, *_ = layouts
    return {
        name: _run_moe(flags, save if name == first else None)[0] for name, flags in layouts.items()
    }


@pytest.fixture(scope="module")
def single_save(tmp_path_factory):
    """Where the one-process run saves its step-2 checkpoint."""
    return str(tmp_path_factory.mktemp("single") / "ckpt")


@pytest.fixture(scope="module")
def single_mixtral(single_save):
    """The one-process reference run."""
    return run_distributed(_trainer_layouts, 1, {"single": []}, single_save)[0]


def _check_layouts(single, results, loss_rtol=1e-5, param_rtol=1e-4):
    """Every layout of `results` (per rank: name -> run) against the one-process run: loss
    curve, weights, validation loss (same relative tolerance as the losses) and the auxiliary
    losses of the last micro-batch (1e-5 relative)."""
    from tests.parallel.parity import max_loss_diff, max_param_diff

    for name in results[0]:
        for rank, by_layout in enumerate(results):
            got = by_layout[name]
            ref = single["single"]
            assert ref["losses"][-1] < ref["losses"][0]
            loss_diff = max_loss_diff(ref["losses"], got["losses"])
            param_diff = max_param_diff(ref["params"], got["params"])
            print(f"{name} rank {rank}: loss rel {loss_diff:.2e}, params rel {param_diff:.2e}")
            assert loss_diff < loss_rtol, (name, rank, loss_diff)
            assert param_diff < param_rtol, (name, rank, param_diff)
            assert got["valid"] == pytest.approx(ref["valid"], rel=loss_rtol), (name, rank)
            for layer, value in got["aux"].items():
                assert value == pytest.approx(ref["aux"][layer], rel=1e-5), (name, rank, layer)
        assert any(by_layout[name]["aux"] for by_layout in results), name  # some rank compared


def _two_rank_runs(rank, world_size, save):
    """Every 2-process run in one launch: EP2 (saving after step 2), the EP1 resume from that
    checkpoint, TP2 (with its expert placements), TP2 with sequence parallelism and CP2."""
    from services.trainer.arguments import parse_args
    from tests.parallel.parity import BASE, full_parameters
    from training.loop import Trainer

    flags = [*BASE, "--train-iters", str(TRAINER_STEPS), *MIXTRAL]
    ep2 = Trainer(parse_args([*flags, "--save", save, "--expert-model-parallel-size", "2"]))
    losses = []
    for step in range(TRAINER_STEPS):
        losses.append(ep2.train_step().loss)
        if step == 1:
            ep2.save()
            ep2.checkpoints.wait()
    out = {"ep2": {"losses": losses, "params": full_parameters(ep2.model)}}
    ep1 = Trainer(parse_args([*flags, "--load", save]))
    ep1.load()
    out["resumed_ep1"] = ep1.train_step().loss
    out["tp2"], tp2 = _run_moe(["--tensor-model-parallel-size", "2"])
    out["placements"] = {
        name: str(param.placements)
        for name, param in tp2.model.named_parameters()
        if name.startswith("layers.0.mlp.")
    }
    out["tp2-sp"], _ = _run_moe(["--tensor-model-parallel-size", "2", "--sequence-parallel"])
    out["cp2"], _ = _run_moe(["--context-parallel-size", "2"])
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_distributed(_two_rank_runs, 2, str(tmp_path_factory.mktemp("ep2") / "ckpt"))


@pytest.mark.dist
@pytest.mark.slow
def test_trainer_ep2_dp2_equals_one_process(single_mixtral, two_ranks):
    """2 processes, data-parallel 2 with the 4 experts split 2 + 2: the trainer's loss curve and
    final (gathered) weights equal the single-process run's."""
    from tests.parallel.parity import max_loss_diff, max_param_diff

    ref = single_mixtral["single"]
    for result in two_ranks:
        assert max_loss_diff(ref["losses"], result["ep2"]["losses"]) < 1e-5
        assert max_param_diff(ref["params"], result["ep2"]["params"]) < 1e-4


@pytest.mark.dist
@pytest.mark.slow
def test_trainer_cp2_mixtral_equals_one_process(single_mixtral, two_ranks):
    """Context parallelism with the load-balancing loss on: the two ranks route sequence chunks
    and sum their per-expert copy counts and probability sums (and z-loss sums) over the cp
    group before forming the losses, so the losses, their gradient and the logged auxiliary
    losses equal one process's."""
    _check_layouts(single_mixtral, [{"cp2": r["cp2"]} for r in two_ranks])


@pytest.mark.dist
@pytest.mark.slow
def test_ep2_checkpoint_resumes_under_ep1(single_mixtral, two_ranks):
    """DCP keeps the experts' global [X, ...] tensors: resumed under EP1 (every rank holding all
    experts) from EP2's step-2 checkpoint, the next loss equals the uninterrupted run's third."""
    for result in two_ranks:
        assert result["resumed_ep1"] == pytest.approx(
            single_mixtral["single"]["losses"][2], rel=1e-5
        )


@pytest.mark.dist
@pytest.mark.slow
def test_trainer_tp2_mixtral_equals_one_process(single_mixtral, two_ranks):
    """Tensor parallelism of the experts (each expert's [gate; up] column-parallel, down
    row-parallel, router replicated), without and with sequence parallelism (the MoE layer
    all-gathers its sequence shard, routes the whole micro-batch, reduce-scatters the experts'
    partial outputs): TP2 tiny-mixtral trains like one process, with the same router
    auxiliary losses and validation loss."""
    _check_layouts(single_mixtral, [{k: r[k] for k in ("tp2", "tp2-sp")} for r in two_ranks])
    for result in two_ranks:
        assert result["placements"] == {
            "layers.0.mlp.gate.weight": "(Replicate(),)",  # router
            "layers.0.mlp.experts.gate_up_proj": "(Replicate(),)",  # each rank computes its rows
            "layers.0.mlp.experts.down_proj": "(Shard(dim=2),)",  # row-parallel: F split
        }


def test_expert_parallel_flag_is_validated():
    from models.registry import get_config
    from parallel.parallel_dims import ParallelDims
    from parallel.parallelize import check_model
    from services.trainer.arguments import parse_args

    base = ["--mock-data", "--model", "tiny-mixtral", "--expert-model-parallel-size"]
    assert parse_args([*base, "2"]).parallel.expert_model_parallel_size == 2
    assert parse_args([*base, "2", "--pipeline-model-parallel-size", "2"]).parallel
    assert parse_args([*base, "2", "--zero-stage", "1"]).parallel.zero_stage == 1
    assert parse_args([*base, "2", "--use-distributed-optimizer"]).parallel.zero_stage == 1
    assert parse_args([*base, "2", "--zero-stage", "3", "--hsdp"]).parallel.hsdp
    with pytest.raises(ValueError, match="must be >= 1"):
        parse_args([*base, "0"])
    with pytest.raises(ValueError, match="must divide the data-parallel size 6"):
        parse_args([*base, "4"]).validate(6)
    parse_args([*base, "4"]).validate(8)
    with pytest.raises(ValueError, match="must divide the data-parallel shard size 6"):
        ParallelDims(world_size=6, ep=4)
    mixtral = get_config("tiny-mixtral")  # 4 experts
    with pytest.raises(ValueError, match="must divide --num-experts 4"):
        check_model(ParallelDims(world_size=3, ep=3), mixtral)
    with pytest.raises(ValueError, match="needs an MoE model"):
        check_model(ParallelDims(world_size=2, ep=2), get_config("tiny-llama"))
    check_model(ParallelDims(world_size=4, ep=2), mixtral)
    sp = ParallelDims(world_size=2, tp=2, sequence_parallel=True)
    check_model(sp, mixtral)
    # Shared experts under SP: tests/parallel/test_family_layouts.py (tiny-qwen2-moe tp2-sp).
    check_model(sp, get_config("tiny-mixtral", moe={**MOE, "num_shared_experts": 1}))


def _four_rank_runs(rank, world_size, layouts, save, single_save):
    """Every layout of `layouts`, the first (ZeRO-1) saving its step-2 checkpoint to `save`,
    then the first layout resumed from it and from the one-process checkpoint `single_save`.
    Returns the results by layout, each resumed run's next two losses, and how the first layout holds two parameters' Adam state: (mesh axes,
    placements, global shape, local shape) of its DTensor."""
    from services.trainer.arguments import parse_args
    from tests.parallel.parity import BASE
    from training.loop import Trainer

    first, *_ = layouts
    results, trainer = _run_moe(layouts[first], save)
    state = trainer.optimizer.inner.sharded_state_dict()
    layout = {}
    for fqn in ("layers.0.mlp.experts.gate_up_proj", "embed_tokens.weight"):
        value = state[f"state.{fqn}.exp_avg"]
        layout[fqn] = (
            value.device_mesh.mesh_dim_names,
            tuple(value.placements),
            tuple(value.shape),
            tuple(value.to_local().shape),
        )
    out = {"layouts": {first: results}, "zero1_state": layout}
    for name, flags in list(layouts.items())[1:]:
        out["layouts"][name] = _run_moe(flags)[0]
    for key, load in (("resumed", save), ("from_single", single_save)):
        flags = [*BASE, "--train-iters", str(TRAINER_STEPS), *MIXTRAL, *layouts[first]]
        resumed = Trainer(parse_args([*flags, "--load", load]))
        resumed.load()
        out[key] = [resumed.train_step().loss for _ in range(2)]
    return out


def _resume_one_process(rank, world_size, save):
    """One process (all experts, plain optimizer) resumed from `save`: its next two losses."""
    from services.trainer.arguments import parse_args
    from tests.parallel.parity import BASE
    from training.loop import Trainer

    trainer = Trainer(
        parse_args([*BASE, "--train-iters", str(TRAINER_STEPS), *MIXTRAL, "--load", save])
    )
    trainer.load()
    return [trainer.train_step().loss for _ in range(2)]


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory, single_mixtral, single_save):
    """Data-parallel 4: EP2 with ZeRO-1 (saving at step 2, then resumed under the same layout,
    and resumed from the one-process run's checkpoint: `single_mixtral` wrote it);
    EP2 (experts also reduced over the 2 `edp` ranks that hold the same ones) and EP4 (one
    expert per rank); TP2 or CP2 x data-parallel 2 with EP2 (each TP rank runs its ep block
    whole; CP ranks reduce their experts' gradients together); ZeRO-2/3; TP2 x EP2 with
    sequence parallelism (each TP rank sends only its sequence shard's copies, so expert
    gradients are summed over tp too); PP2 x EP2 (each stage's ep group exchanges its own
    layers' copies; the auxiliary losses reach the gradient on both stages; the expert sync
    launched per chunk after its last backward); HSDP 2x2 x EP2."""
    ep2 = ["--expert-model-parallel-size", "2"]
    layouts = {
        # ZeRO-1: the experts' optimizer state is chunked over the 2 `edp` ranks holding them,
        # the rest over all 4; checkpoints keep the global layout.
        "ep2-edp2-zero1": [*ep2, "--zero-stage", "1"],
        "ep2-edp2": ep2,
        "ep4": ["--expert-model-parallel-size", "4"],
        "tp2-ep2": ["--tensor-model-parallel-size", "2", *ep2],
        "ep2-edp2-zero3": [*ep2, "--zero-stage", "3"],
        "cp2-ep2": ["--context-parallel-size", "2", *ep2],
        "tp2-ep2-zero2": ["--tensor-model-parallel-size", "2", *ep2, "--zero-stage", "2"],
        "tp2-ep2-sp": ["--tensor-model-parallel-size", "2", *ep2, "--sequence-parallel"],
        "pp2-ep2": ["--pipeline-model-parallel-size", "2", *ep2, "--overlap-grad-reduce"],
        "hsdp2x2-ep2": [*ep2, "--zero-stage", "2", "--hsdp", "--hsdp-shard-size", "2"],
    }
    save = str(tmp_path_factory.mktemp("ep2-zero1") / "ckpt")
    return save, run_distributed(_four_rank_runs, 4, layouts, save, single_save)


@pytest.mark.dist
@pytest.mark.slow
def test_trainer_ep_over_four_ranks_equals_one_process(single_mixtral, four_ranks):
    """Every layout of the 4-rank launch (see `four_ranks`) trains like one process."""
    _check_layouts(single_mixtral, [out["layouts"] for out in four_ranks[1]])


@pytest.mark.dist
@pytest.mark.slow
def test_ep2_zero1_checkpoints_move_to_and_from_one_process(single_mixtral, four_ranks):
    """EP2 ZeRO-1's step-2 checkpoint (expert state as DTensors over (ep, edp), the rest over
    dp, under the global names) resumes under EP2 ZeRO-1 and in one process holding every
    expert and the whole optimizer state, and the one-process checkpoint resumes under EP2
    ZeRO-1: the next two losses equal the uninterrupted run's third and fourth (the fourth
    depends on the restored Adam state)."""
    save, results = four_ranks
    expected = single_mixtral["single"]["losses"][2:4]
    for out in results:
        assert out["resumed"] == pytest.approx(expected, rel=1e-5)
        assert out["from_single"] == pytest.approx(expected, rel=1e-5)
    assert run_distributed(_resume_one_process, 1, save)[0] == pytest.approx(expected, rel=1e-5)


@pytest.mark.dist
@pytest.mark.slow
def test_ep2_zero1_shards_expert_state_over_edp_only(four_ranks):
    """EP2 x edp 2: an expert weight's Adam state is chunked over the 2 ranks holding the same
    experts (2 experts per ep rank, one per edp rank) on the (ep, edp) mesh; a replicated
    weight's over all 4 data-parallel ranks."""
    from torch.distributed.tensor import Shard

    for out in four_ranks[1]:
        experts = out["zero1_state"]["layers.0.mlp.experts.gate_up_proj"]
        embed = out["zero1_state"]["embed_tokens.weight"]
        assert experts[:2] == (("ep", "edp"), (Shard(0), Shard(0)))
        assert experts[2][0] == 4 and experts[3] == (1, *experts[2][1:])
        assert embed[:2] == (("dp_shard",), (Shard(0),))
        assert embed[3] == (embed[2][0] // 4, *embed[2][1:])


def _bf16_losses(rank, world_size, flags):
    from services.trainer.arguments import parse_args
    from tests.parallel.parity import BASE
    from training.loop import Trainer

    argv = [*BASE, "--train-iters", "2", *MIXTRAL, "--bf16", "--zero-stage", "1", *flags]
    trainer = Trainer(parse_args(argv))
    assert trainer.plan.mode == "autocast"
    return [trainer.train_step().loss for _ in range(2)]


@pytest.mark.dist
def test_autocast_moe_under_expert_parallelism():
    """--bf16 with ZeRO-1 runs the experts under autocast: their bf16 outputs travel back through
    the all-to-all and are summed into the fp32 stream. EP2 gives one process's losses: the first
    step identical, the second within bf16's rounding of the expert outputs (measured 3e-7
    relative on one CPU, 1.2e-5 on a 2-core AMD EPYC whose bf16 kernels round differently; the
    bound is a tenth of bf16's 2^-8 step, so it holds on any CPU)."""
    one = run_distributed(_bf16_losses, 1, [])[0]
    ep2 = run_distributed(_bf16_losses, 2, ["--expert-model-parallel-size", "2"])
    for losses in ep2:
        assert losses[0] == pytest.approx(one[0], rel=1e-6)
        assert losses == pytest.approx(one, rel=4e-4)
