"""The preference stages under sharded weights (ZeRO-2/3), tensor/sequence and pipeline
parallelism and their combinations, on real gloo ranks, give the 1-process losses and metrics.

Tolerances are those of the data-parallel test (tests/training/test_alignment_dist.py) and of the
layout parity tests (tests/parallel/test_parity.py): the layouts add the same numbers in another
order (row-parallel all-reduce, split softmax, sharded gradient norms), so the loss curves agree
to 1e-5 relative and trl's logged quantities to 1e-4.
"""

from __future__ import annotations

import pytest

from services.trainer.arguments import parse_args
from tests.harness import run_distributed
from tests.training.test_alignment_dist import _all, _curve
from tests.training.test_alignment_train import _flags, pair_prefix  # noqa: F401
from training.loop import Trainer

LOSS_RTOL = 1e-5
METRIC_RTOL = 1e-4
STEPS = "3"
PP2 = ("--pipeline-model-parallel-size", "2")
TP2 = ("--tensor-model-parallel-size", "2")
SP = ("--sequence-parallel",)
LORA = ("--lora-target-modules", "query_key_value", "--lora-r", "4")
STAGES = {
    "rm": ("rm",),
    "dpo": ("dpo", "--dpo-beta", "0.5"),
    "simpo": ("simpo",),
    "orpo": ("orpo",),
    "dpo-lora": ("dpo", "--dpo-beta", "0.5", *LORA),
    # 4 layers: 2 virtual chunks of 1 layer on each of 2 pipeline ranks.
    "rm-4l": ("rm", "--num-layers", "4"),
    "dpo-4l": ("dpo", "--dpo-beta", "0.5", "--num-layers", "4"),
    "orpo-4l": ("orpo", "--num-layers", "4"),
}
"""Each stage's flags (the one-process run of a stage is shared by its layouts)."""
SHARDED = {
    "rm-zero3": ("rm", "--zero-stage", "3"),
    "dpo-zero2": ("dpo", "--zero-stage", "2"),
    "dpo-zero3": ("dpo", "--zero-stage", "3"),
    "simpo-zero3": ("simpo", "--zero-stage", "3"),
    "orpo-zero2": ("orpo", "--zero-stage", "2"),
    "dpo-lora-zero3": ("dpo-lora", "--zero-stage", "3"),
}
"""Case name -> (stage, layout flags): data parallel over 2 ranks with sharded weights."""
TENSOR = {
    "rm-tp2-sp": ("rm", *TP2, *SP),
    "dpo-tp2": ("dpo", *TP2),
    "dpo-tp2-sp": ("dpo", *TP2, *SP),
    "simpo-tp2-sp": ("simpo", *TP2, *SP),
    "orpo-tp2": ("orpo", *TP2),
    "dpo-lora-tp2": ("dpo-lora", *TP2),
}
"""Tensor parallelism over 2 ranks, with and without sequence parallelism."""
PIPELINE = {
    "rm-pp2": ("rm", *PP2),
    "dpo-pp2": ("dpo", *PP2),
    "simpo-pp2": ("simpo", *PP2),
    "orpo-pp2": ("orpo", *PP2),
    "dpo-lora-pp2": ("dpo-lora", *PP2),
}
"""Pipeline parallelism over 2 ranks (1F1B; 2 micro-batches a step)."""
VIRTUAL = ("--num-layers-per-virtual-pipeline-stage", "1")
SCHEDULES = {
    "dpo-interleaved-1f1b": ("dpo-4l", *PP2, *VIRTUAL),
    "orpo-zbv": ("orpo-4l", *PP2, *VIRTUAL, "--pipeline-schedule", "zbv"),
    # DualPipeV needs a micro-batch per stage: 4 of 2 pairs (rm's loss is a pair mean).
    "rm-dualpipev": (
        "rm-4l",
        *PP2,
        *VIRTUAL,
        "--pipeline-schedule",
        "dualpipev",
        "--micro-batch-size",
        "2",
    ),
}
"""Virtual pipeline stages, looped and V-shaped (the first and last stage on rank 0)."""
MODEL_PARALLEL_4 = {
    "dpo-tp2-pp2": ("dpo", *TP2, *PP2),
    "rm-tp2-sp-pp2": ("rm", *TP2, *SP, *PP2),
}
"""Tensor and pipeline parallelism together on 4 ranks."""
DATA_PARALLEL_4 = {
    "orpo-tp2-zero3-dp2": ("orpo", *TP2, "--zero-stage", "3"),
    # 2 micro-batches of 2 pairs a step on each pipeline: the pair-mean losses do not depend on
    # the micro-batching (ORPO's NLL term, a mean per micro-batch, would).
    "simpo-pp2-dp2": ("simpo", *PP2, "--micro-batch-size", "2"),
}
"""Model parallelism inside 2 data-parallel replicas (FSDP2 over TP; GradSync over PP)."""


def _flags_of(sentencepiece_model, prefix, stage: str, *layout: str) -> list[str]:
    return _flags(sentencepiece_model, prefix, *STAGES[stage], "--train-iters", STEPS, *layout)


def _check_layouts(sentencepiece_model, prefix, cases: dict, world_size: int) -> None:
    """Run every case on `world_size` ranks and each stage once in this process; compare."""
    runs = {name: _flags_of(sentencepiece_model, prefix, *case) for name, case in cases.items()}
    results = run_distributed(_all, world_size, runs)[0]  # rank 0 logs the all-reduced numbers
    singles = {
        case[0]: _curve(_flags_of(sentencepiece_model, prefix, case[0])) for case in cases.values()
    }
    for name, (stage, *_) in cases.items():
        single = singles[stage]
        assert len(single) == int(STEPS)
        for (loss, metrics), (got, got_metrics) in zip(single, results[name], strict=True):
            assert got == pytest.approx(loss, rel=LOSS_RTOL, abs=1e-6), name
            if abs(metrics.get("rewards/margins", 1.0)) < 1e-5:
                # DPO's first step (the policy is its reference): every margin is rounding
                # noise, so which side wins (the accuracy) is not a quantity to compare.
                metrics = {k: v for k, v in metrics.items() if k != "rewards/accuracies"}
                got_metrics = {k: v for k, v in got_metrics.items() if k != "rewards/accuracies"}
            assert got_metrics == pytest.approx(metrics, rel=METRIC_RTOL, abs=1e-5), name


@pytest.mark.dist
def test_sharded_weights_match_one_process(sentencepiece_model, pair_prefix):  # noqa: F811
    _check_layouts(sentencepiece_model, pair_prefix, SHARDED, 2)


@pytest.mark.dist
def test_tensor_parallel_matches_one_process(sentencepiece_model, pair_prefix):  # noqa: F811
    _check_layouts(sentencepiece_model, pair_prefix, TENSOR, 2)


@pytest.mark.dist
def test_pipeline_parallel_matches_one_process(sentencepiece_model, pair_prefix):  # noqa: F811
    _check_layouts(sentencepiece_model, pair_prefix, PIPELINE, 2)


@pytest.mark.dist
def test_virtual_pipeline_schedules_match_one_process(sentencepiece_model, pair_prefix):  # noqa: F811
    _check_layouts(sentencepiece_model, pair_prefix, SCHEDULES, 2)


@pytest.mark.dist
def test_tensor_with_pipeline_parallel_matches_one_process(
    sentencepiece_model,
    pair_prefix,  # noqa: F811
):
    _check_layouts(sentencepiece_model, pair_prefix, MODEL_PARALLEL_4, 4)


@pytest.mark.dist
def test_model_parallel_replicas_match_one_process(
    sentencepiece_model,
    pair_prefix,  # noqa: F811
):
    _check_layouts(sentencepiece_model, pair_prefix, DATA_PARALLEL_4, 4)


RESUMED = {"dpo-pp2": PP2, "dpo-zero3": ("--zero-stage", "3"), "dpo-tp2-sp": (*TP2, *SP)}
"""Layouts in which a DPO run reads --ref-model and is resumed."""


def _train_and_resume(rank: int, world_size: int, runs: dict, directory: str) -> dict:
    """Per layout: 4 steps; a run stopped and saved at step 2 (--exit-interval), resumed to 4."""
    out = {}
    for name, flags in runs.items():
        save = f"{directory}/{name}"
        full: list[dict] = []
        Trainer(parse_args(flags), on_metrics=full.append).fit()
        Trainer(parse_args([*flags, "--exit-interval", "2", "--save", save])).fit()
        resumed: list[dict] = []
        trainer = Trainer(parse_args([*flags, "--load", save]), on_metrics=resumed.append)
        assert trainer.load() == 2
        trainer.fit()
        out[name] = (full, resumed)
    return out


@pytest.mark.dist
def test_ref_model_and_resume_under_sharded_layouts(
    sentencepiece_model,
    pair_prefix,  # noqa: F811
    tmp_path,
):
    """--ref-model read into shards equals the starting copy; a resumed run continues exactly."""
    start = tmp_path / "start"  # the weights a --seed 3 run starts from
    Trainer(
        parse_args(_flags_of(sentencepiece_model, pair_prefix, "dpo", "--save", str(start)))
    ).save()
    four = ("--train-iters", "4", "--ref-model", str(start))
    runs = {
        name: _flags_of(sentencepiece_model, pair_prefix, "dpo", *four, *layout)
        for name, layout in RESUMED.items()
    }
    results = run_distributed(_train_and_resume, 2, runs, str(tmp_path / "runs"))[0]
    single = _curve(_flags_of(sentencepiece_model, pair_prefix, "dpo", "--train-iters", "4"))
    for name, (full, resumed) in results.items():
        curve = [(r["loss"], r["objective"]) for r in full]
        for (loss, metrics), (got, got_metrics) in zip(single, curve, strict=True):
            assert got == pytest.approx(loss, rel=LOSS_RTOL, abs=1e-6), name
            assert got_metrics["rewards/margins"] == pytest.approx(
                metrics["rewards/margins"], rel=METRIC_RTOL, abs=1e-5
            ), name
        assert [r["loss"] for r in resumed] == [r["loss"] for r in full[2:]], name
        assert [r["objective"] for r in resumed] == [r["objective"] for r in full[2:]], name


def _validation(rank: int, world_size: int, runs: dict) -> dict:
    return {name: Trainer(parse_args(flags)).fit().val_loss for name, flags in runs.items()}


@pytest.mark.dist
def test_pipeline_validation_matches_one_process(sentencepiece_model, pair_prefix):  # noqa: F811
    """The held-out pairs' loss under PP2 (the forward-only pass, scored at the last stage)."""
    evaluate = ("--eval-interval", "2", "--eval-iters", "2", "--train-iters", "2")
    runs = {
        stage: _flags_of(sentencepiece_model, pair_prefix, stage, *evaluate, *PP2)
        for stage in ("rm", "dpo")
    }
    results = run_distributed(_validation, 2, runs)[0]
    for stage in runs:
        single = _validation(
            0, 1, {stage: _flags_of(sentencepiece_model, pair_prefix, stage, *evaluate)}
        )
        assert single[stage] is not None and single[stage] > 0, stage
        assert results[stage] == pytest.approx(single[stage], rel=LOSS_RTOL), stage
