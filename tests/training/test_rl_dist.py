"""--stage grpo and ppo under data parallelism (2 real gloo ranks) give the 1-process run.

Each rank rolls out its own share of the prompts with its colocated engine (a prompt's whole
group on one rank: the group statistic never crosses ranks), the loss counts are all-reduced
before the step's first forward and the gradients are all-reduced, so the loss is the same
token- or sequence-normalised mean as in one process. The samplers are seeded by each sample's
position in the run, so both layouts draw the same completions and the curves agree.
"""

from __future__ import annotations

import pytest

from services.trainer.arguments import parse_args
from services.trainer.rollouts import colocated_rollouts
from tests.harness import run_distributed
from tests.training.test_grpo_train import _fixed_rollouts, _flags, digit_task  # noqa: F401
from tests.training.test_ppo_train import _ppo_flags
from training.loop import Trainer

FIXED = ("--train-iters", "4", "--micro-batch-size", "2", "--global-batch-size", "8")
"""Fixed rollouts: 8 sequences a step; 4 micro-batches in one process, 2 per rank on two."""


def _curve(
    flags: list[str], online: bool, eval_iters: int = 1
) -> list[tuple[float, dict[str, float]]]:
    """The logged (loss, objective metrics) of a run; for online runs then the validation loss
    over `eval_iters` micro-batches a rank (one process with 2 sees the prompts DP2 sees with 1)."""
    flags = [*flags, "--eval-iters", str(eval_iters)]
    records: list[dict] = []
    if online:
        trainer = Trainer(parse_args(flags), on_metrics=records.append, rollouts=colocated_rollouts)
    else:
        rows = _fixed_rollouts(16, 8 * 4, seed=4)
        trainer = Trainer(parse_args(flags), datasets=(rows, rows), on_metrics=records.append)
    trainer.fit()
    curve = [(r["loss"], r.get("objective", {})) for r in records]
    if online:  # the validation loss too: each rank rolls out its share of the held-out prompts
        curve.append((trainer.evaluate(), {}))
    return curve


def _resumed(flags: list[str], saved: str) -> list[tuple[float, dict[str, float]]]:
    """Two of four steps saved, then resumed: the last two steps' records."""
    Trainer(
        parse_args([*flags, "--train-iters", "2", "--save", saved]), rollouts=colocated_rollouts
    ).fit()
    records: list[dict] = []
    second = Trainer(
        parse_args([*flags, "--train-iters", "4", "--load", saved]),
        on_metrics=records.append,
        rollouts=colocated_rollouts,
    )
    assert second.load() == 2
    second.fit()
    return [(r["loss"], r.get("objective", {})) for r in records]


def _all(rank: int, world_size: int, runs: dict, resume: tuple[list[str], str]) -> dict:
    out = {name: _curve(flags, online) for name, (flags, online) in runs.items()}
    flags, saved = resume
    out["straight"] = _curve([*flags, "--train-iters", "4"], online=True)
    out["resumed"] = _resumed(flags, saved)
    return out


@pytest.mark.dist
@pytest.mark.slow
def test_dp2_grpo_and_ppo_match_one_process(digit_task, tmp_path) -> None:  # noqa: F811
    runs = {
        "grpo-fixed-dapo": (_flags(digit_task, *FIXED, "--loss-type", "dapo", "--beta", "0.04",
                                   "--lr", "1e-2"), False),
        "grpo-fixed-grpo": (_flags(digit_task, *FIXED, "--lr", "1e-2"), False),
        "grpo-online": (_flags(digit_task, "--train-iters", "3"), True),
        "grpo-online-zero1": (_flags(digit_task, "--train-iters", "2", "--beta", "0.04",
                                     "--use-distributed-optimizer"), True),
        "grpo-online-batch-std": (_flags(digit_task, "--train-iters", "2", "--scale-rewards",
                                         "batch", "--loss-type", "dapo"), True),
        "ppo-online": (_ppo_flags(digit_task, "--train-iters", "2", "--micro-batch-size", "2",
                                  "--global-batch-size", "4"), True),
    }  # fmt: skip
    resume_flags = _flags(digit_task, "--num-generations", "4", "--micro-batch-size", "2",
                          "--global-batch-size", "4")  # fmt: skip
    results = run_distributed(_all, 2, runs, (resume_flags, str(tmp_path / "dp2")))
    for name, (flags, online) in runs.items():
        single = _curve(flags, online, eval_iters=2)
        parallel = results[0][name]  # rank 0 logs the all-reduced numbers
        assert len(single) == len(parallel) >= 2, name
        pairs = zip(_untimed(single), _untimed(parallel), strict=True)
        for (loss, metrics), (loss_dp, metrics_dp) in pairs:
            # the bound is 1e-3; the sums differ only in their order
            assert loss_dp == pytest.approx(loss, abs=1e-5), name
            assert metrics_dp == pytest.approx(metrics, rel=1e-4, abs=1e-5), name
        assert abs(single[-1][0] - single[0][0]) > 1e-4 or online, name  # the weights moved
    # The DP2 run resumed at step 2 continues as the straight DP2 run, bit for bit.
    for rank in results:
        assert _untimed(rank["resumed"]) == _untimed(rank["straight"][2:4])  # not its validation


def _untimed(curve: list[tuple[float, dict[str, float]]]) -> list:
    """The records without their wall-clock rates."""
    timed = ("rollout_tokens_per_s",)
    return [(loss, {k: v for k, v in m.items() if k not in timed}) for loss, m in curve]
