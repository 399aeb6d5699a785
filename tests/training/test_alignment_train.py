"""--stage rm / dpo end to end: preprocessed pairs in, a short single-process run whose loss falls,
trl's quantities logged; layouts and flags the preference stages cannot run are refused by name."""

from __future__ import annotations

import math

import pytest
import torch

from services.preprocess.job import PreprocessConfig, run_preprocess
from services.trainer.arguments import parse_args
from tests.fixtures import records as fx
from training.launch_checks import check_inputs, check_paths
from training.loop import Trainer
from training.objectives.dpo import DPOLoss
from training.objectives.rm import RewardLoss

COLOURS = ["red", "green", "blue", "yellow", "purple", "orange", "black", "white"]


@pytest.fixture(scope="module")
def pair_prefix(tmp_path_factory, sentencepiece_model):
    """A learnable preference: the chosen reply names a colour, the rejected one says no."""
    records = [
        {
            "prompt": f"Question {i}: name a colour.",
            "chosen": f" The colour is {COLOURS[i % len(COLOURS)]}.",
            "rejected": " No, I will not.",
        }
        for i in range(64)
    ]
    directory = tmp_path_factory.mktemp("pairs")
    path = fx.write_jsonl(directory / "pairs.jsonl", records)
    prefix = directory / "pairs"
    run_preprocess(
        PreprocessConfig(
            input=(str(path),),
            output_prefix=str(prefix),
            tokenizer_type="SentencePiece",
            tokenizer_model=str(sentencepiece_model),
            handler_name="preference",
            seq_length=32,
        )
    )
    return str(prefix)


def _flags(sentencepiece_model, prefix, stage, *extra):
    return [
        "--model", "tiny-llama", "--stage", stage, "--data-path", prefix, "--split", "90,10,0",
        "--tokenizer-type", "SentencePiece", "--tokenizer-model", str(sentencepiece_model),
        "--seq-length", "32", "--micro-batch-size", "4", "--global-batch-size", "8",
        "--train-iters", "12", "--lr", "2e-3", "--eval-interval", "0", "--log-interval", "1",
        "--seed", "3", *extra,
    ]  # fmt: skip


def _run(flags):
    records: list[dict] = []
    trainer = Trainer(parse_args(flags), on_metrics=records.append)
    summary = trainer.fit()
    return trainer, summary, records


def test_dpo_run_starts_at_ln2_and_learns_the_preference(
    sentencepiece_model, pair_prefix, tmp_path
):
    flags = _flags(sentencepiece_model, pair_prefix, "dpo", "--dpo-beta", "0.5")
    trainer, summary, records = _run([*flags, "--save", str(tmp_path)])
    assert isinstance(trainer.objective, DPOLoss) and trainer.objective.beta == 0.5
    assert abs(records[0]["loss"] - math.log(2)) < 1e-5  # the policy is its reference
    assert summary.final_loss < 0.5 * math.log(2)
    first, last = records[0]["objective"], records[-1]["objective"]
    assert set(first) == {
        "rewards/chosen",
        "rewards/rejected",
        "rewards/accuracies",
        "rewards/margins",
        "logps/chosen",
        "logps/rejected",
    }
    assert abs(first["rewards/margins"]) < 1e-5
    assert last["rewards/accuracies"] == 1.0 and last["rewards/margins"] > 0.5
    # Resuming without --ref-model would take the trained weights for the reference: refused
    # before any worker, and by the objective itself should a worker be started anyway.
    resumed = parse_args([*flags, "--load", str(tmp_path), "--train-iters", "14"])
    with pytest.raises(ValueError, match=r"--stage dpo with --load .*resuming needs the reference"):
        check_paths(resumed)
    worker = Trainer(resumed)
    worker.load()
    with pytest.raises(ValueError, match="resumed at step 12"):
        worker.train_step()
    # Starting from those weights (--finetune) is a new run: the policy is its reference again.
    tuned = Trainer(parse_args([*flags, "--load", str(tmp_path), "--finetune"]))
    tuned.load()
    assert tuned.train_step().loss == pytest.approx(math.log(2), abs=1e-5)


def test_dpo_label_smoothing_and_loss_type_reach_the_objective(sentencepiece_model, pair_prefix):
    flags = _flags(
        sentencepiece_model,
        pair_prefix,
        "dpo",
        "--dpo-loss-type",
        "robust",
        "--dpo-label-smoothing",
        "0.1",
        "--train-iters",
        "1",
    )
    trainer = Trainer(parse_args(flags))
    assert (trainer.objective.loss_type, trainer.objective.label_smoothing) == ("robust", 0.1)
    # rDPO at h = 0: (-(0.9) log σ(0) + 0.1 log σ(0)) / 0.8 = ln 2.
    assert trainer.train_step().loss == pytest.approx(math.log(2), abs=1e-5)


def test_reward_model_run_learns_to_rank_the_pairs(sentencepiece_model, pair_prefix):
    flags = _flags(sentencepiece_model, pair_prefix, "rm")
    flags[flags.index("--eval-interval") + 1] = "6"  # the held-out pairs (--split 90,10,0)
    trainer, summary, records = _run([*flags, "--eval-iters", "1"])
    assert isinstance(trainer.objective, RewardLoss)
    assert trainer.model.lm_head.out_features == 1  # the value head replaced the vocabulary head
    assert summary.final_loss < 0.5 * summary.first_loss
    last = records[-1]["objective"]
    assert {"accuracy", "margin", "rewards/chosen", "rewards/rejected"} == set(last)
    assert last["accuracy"] == 1.0 and last["margin"] > 0
    assert summary.val_loss is not None and summary.val_loss < 0.5 * summary.first_loss


def test_reward_model_starts_from_sft_weights_with_a_fresh_value_head(
    sentencepiece_model, pair_prefix, tmp_path
):
    """--stage rm --load SFT --finetune: the backbone is the SFT checkpoint's, the value head
    the fresh initialisation the run would have had without --load; then it learns the pairs."""
    sft_dir = tmp_path / "sft"
    sft_flags = _flags(
        sentencepiece_model,
        pair_prefix,
        "sft",
        "--mock-data",
        "--vocab-size",
        "512",
        "--save",
        str(sft_dir),
    )
    sft_flags[sft_flags.index("--train-iters") + 1] = "2"
    for flag in ("--data-path", "--split"):  # mock token data, not the pairs
        at = sft_flags.index(flag)
        del sft_flags[at : at + 2]
    sft, _, _ = _run(sft_flags)
    sft.save()
    sft_weights = {n: p.detach().clone() for n, p in sft.model.named_parameters()}
    assert sft.model.lm_head is None or sft.model.lm_head.out_features > 1

    flags = _flags(sentencepiece_model, pair_prefix, "rm")
    fresh = Trainer(parse_args(flags)).model.lm_head.weight.detach().clone()
    trainer = Trainer(parse_args([*flags, "--load", str(sft_dir), "--finetune"]))
    trainer.load()
    loaded = dict(trainer.model.named_parameters())
    assert torch.equal(loaded.pop("lm_head.weight"), fresh)
    assert set(loaded) == {n for n in sft_weights if not n.startswith("lm_head")}
    for name, param in loaded.items():
        assert torch.equal(param, sft_weights[name]), name
    summary = trainer.fit()
    assert summary.final_loss < 0.5 * summary.first_loss
    # A reward model's checkpoint (config.json says value_head) loads whole, its head included.
    rm_dir = tmp_path / "rm"
    trainer.config.run.save = str(rm_dir)
    trainer.save()
    again = Trainer(parse_args([*flags, "--load", str(rm_dir), "--finetune"]))
    again.load()
    assert torch.equal(again.model.lm_head.weight, trainer.model.lm_head.weight)


@pytest.mark.parametrize(
    ("extra", "world", "message"),
    [
        (("--context-parallel-size", "2"), 2, "--context-parallel-size 2 with --stage dpo"),
        (
            ("--expert-model-parallel-size", "2", "--model", "tiny-mixtral"),
            2,
            "--expert-model-parallel-size 2 with --stage dpo",
        ),
        (("--peft-method", "bitfit"), 1, "--peft-method with --stage dpo"),
        (("--recompute-granularity", "full"), 1, "--recompute-granularity with --stage dpo"),
        (("--dpo-beta", "0"), 1, "--dpo-beta must be > 0"),
        (("--dpo-loss-type", "hinge", "--dpo-label-smoothing", "0.1"), 1, "no effect on"),
        (("--eod-mask-loss",), 1, "--eod-mask-loss with --stage dpo"),
        (("--variable-seq-lengths",), 1, "--variable-seq-lengths with --stage dpo"),
    ],
)
def test_unsupported_combinations_are_refused_before_any_worker(
    sentencepiece_model, pair_prefix, extra, world, message
):
    config = parse_args(_flags(sentencepiece_model, pair_prefix, "dpo", *extra))
    with pytest.raises(ValueError, match=message):
        config.validate(world)


def test_the_launch_input_check_opens_pairwise_shards(sentencepiece_model, pair_prefix, tmp_path):
    # `meshline train --nproc-per-node N` checks every input before launching workers; it used
    # to open a preference stage's prefix as token shards and refuse it.
    check_inputs(parse_args(_flags(sentencepiece_model, pair_prefix, "dpo")))
    missing = str(tmp_path / "none")
    with pytest.raises(ValueError, match=f"--data-path {missing}"):
        check_inputs(parse_args(_flags(sentencepiece_model, missing, "rm")))


def test_dpo_flags_without_the_dpo_stage_are_refused(sentencepiece_model, pair_prefix):
    with pytest.raises(ValueError, match="--dpo-beta only apply to --stage dpo"):
        parse_args(_flags(sentencepiece_model, pair_prefix, "rm", "--dpo-beta", "0.2"))


def test_token_shards_given_to_a_preference_stage_are_named(sentencepiece_model, tmp_path):
    flags = _flags(sentencepiece_model, str(tmp_path / "nothing"), "rm")
    with pytest.raises(ValueError, match="no pairwise shards"):
        Trainer(parse_args(flags))


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["rm", "dpo"])
def test_accumulation_1x8_equals_8x1(sentencepiece_model, pair_prefix, stage):
    """trl's invariant: 8 micro-batches of 1 pair and 1 micro-batch of 8 give one loss curve."""
    curves = []
    for micro in ("1", "8"):
        flags = _flags(sentencepiece_model, pair_prefix, stage, "--train-iters", "20")
        flags[flags.index("--micro-batch-size") + 1] = micro
        _, _, records = _run(flags)
        curves.append([r["loss"] for r in records])
    assert len(curves[0]) == 20
    assert max(abs(a - b) for a, b in zip(*curves, strict=True)) < 1e-3


def test_simpo_run_learns_the_preference_without_a_reference(sentencepiece_model, pair_prefix):
    flags = _flags(sentencepiece_model, pair_prefix, "simpo", "--gamma-beta-ratio", "0.5")
    trainer, summary, records = _run(flags)
    assert (trainer.objective.beta, trainer.objective.gamma) == (2.5, 1.25)
    assert summary.final_loss < 0.5 * summary.first_loss
    assert records[-1]["objective"]["rewards/accuracies"] == 1.0
    with pytest.raises(ValueError, match="--simpo-beta only apply to --stage simpo"):
        parse_args(_flags(sentencepiece_model, pair_prefix, "dpo", "--simpo-beta", "2"))
    with pytest.raises(ValueError, match="--simpo-beta must be > 0"):
        parse_args(_flags(sentencepiece_model, pair_prefix, "simpo", "--simpo-beta", "0")).validate(
            1
        )
