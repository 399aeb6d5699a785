"""The objective registry: `sft` is the loop's loss, --stage picks it, another objective plugs in."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from services.trainer.arguments import parse_args
from training.config import DataSection, ModelSection, RunSection, TrainingConfig
from training.loop import Trainer
from training.objectives import OBJECTIVES, ForwardContext, ObjectiveOutput, build_objective
from training.objectives.sft import NextTokenLoss, counted_tokens

SEQ = 32


def _config(**run: int) -> TrainingConfig:
    """A library-only config (no service, no CLI): the registry model on mock data."""
    return TrainingConfig(
        model=ModelSection(model="tiny-llama", seq_length=SEQ),
        data=DataSection(mock_data=True),
        run=RunSection(train_iters=3, eval_interval=0, log_interval=1, seed=5, **run),
    )


class CountingNextToken(NextTokenLoss):
    """`sft` plus one logged metric: the tokens it scored (what a new objective looks like)."""

    def compute(
        self, model: nn.Module, batch: dict[str, torch.Tensor], ctx: ForwardContext
    ) -> ObjectiveOutput:
        out = super().compute(model, batch, ctx)
        return ObjectiveOutput(out.loss_sum, {"scored_tokens": counted_tokens(batch)})


def test_registry_is_keyed_by_the_stage_name_and_refuses_others_by_flag() -> None:
    assert isinstance(build_objective("sft"), NextTokenLoss)
    assert set(OBJECTIVES) == {"sft", "rm", "dpo", "simpo", "orpo", "grpo", "ppo"}
    with pytest.raises(
        ValueError,
        match=r"--stage 'kto'.*known: \['dpo', 'grpo', 'orpo', 'ppo', 'rm', 'sft', 'simpo'\]",
    ):
        build_objective("kto")


def test_stage_flag_defaults_to_sft_and_refuses_unbuilt_objectives(
    capsys: pytest.CaptureFixture[str],
) -> None:
    flags = ["--model", "tiny-llama", "--mock-data"]
    assert parse_args(flags).run.stage == "sft"
    assert parse_args([*flags, "--stage", "sft"]).run.stage == "sft"
    with pytest.raises(SystemExit):
        parse_args([*flags, "--stage", "kto"])
    assert "argument --stage: invalid choice: 'kto'" in capsys.readouterr().err


def test_the_library_trains_without_the_service_and_a_plugged_objective_logs_metrics() -> None:
    reference = Trainer(_config())
    assert isinstance(reference.objective, NextTokenLoss)
    expected = [reference.train_step().loss for _ in range(3)]

    records: list[dict] = []
    plugged = Trainer(_config(), on_metrics=records.append)
    plugged.objective = CountingNextToken()
    summary = plugged.fit()
    assert [r["loss"] for r in records] == expected  # same loss, same numbers
    assert summary.final_loss == expected[-1]
    # Mock samples count every token: micro-batch 1 x one data-parallel rank x SEQ per step.
    assert [r["objective"] for r in records] == [{"scored_tokens": float(SEQ)}] * 3
