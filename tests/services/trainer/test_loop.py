"""The training loop on the real tiny Llama: accumulation, loss falls, fp16 skips, NaN policy, metrics."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from services.trainer.arguments import parse_args
from services.trainer.plot import plot_run
from training.loop import NonFiniteLossError, Trainer
from training.metrics import CSV_COLUMNS, read_csv

BASE = [
    "--model",
    "tiny-llama",
    "--mock-data",
    "--seq-length",
    "32",
    "--eval-interval",
    "0",
    "--seed",
    "3",
]


def _trainer(*flags: str) -> Trainer:
    return Trainer(parse_args([*BASE, *flags]))


def _params(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().clone() for n, p in trainer.model.named_parameters()}


def test_accumulation_matches_one_big_micro_batch():
    # SGD: Adam's first steps divide by |g|, amplifying float noise in near-zero gradients.
    flags = ["--train-iters", "3", "--lr", "1e-1", "--global-batch-size", "4", "--optimizer", "sgd"]
    accumulated = _trainer(*flags, "--micro-batch-size", "2")
    single = _trainer(*flags, "--micro-batch-size", "4")
    for _ in range(3):
        a, b = accumulated.train_step(), single.train_step()
        assert a.loss == pytest.approx(b.loss, rel=1e-6)
        assert a.grad_norm == pytest.approx(b.grad_norm, rel=1e-5)
    assert accumulated.state.consumed_samples == single.state.consumed_samples == 12
    for name, p in _params(accumulated).items():
        torch.testing.assert_close(p, _params(single)[name], rtol=1e-5, atol=1e-6, msg=name)


def test_short_run_loss_falls(tmp_path):
    trainer = _trainer(
        "--train-iters",
        "30",
        "--micro-batch-size",
        "8",
        "--lr",
        "5e-3",
        "--lr-warmup-iters",
        "3",
        "--log-interval",
        "5",
        "--log-dir",
        str(tmp_path),
        "--eval-interval",
        "30",
        "--eval-iters",
        "2",
    )
    summary = trainer.fit()
    assert summary.steps == 30
    assert summary.final_loss < summary.first_loss - 0.5, (summary.first_loss, summary.final_loss)
    assert summary.val_loss is not None and summary.val_loss < summary.first_loss
    rows = read_csv(tmp_path / "metrics.csv")
    assert rows["step"] == [5, 10, 15, 20, 25, 30]
    assert all(t > 0 for t in rows["tokens_per_s"]) and all(m > 0 for m in rows["mfu"])
    evals = read_csv(tmp_path / "eval.csv")
    assert evals["val_ppl"][-1] == pytest.approx(math.exp(evals["val_loss"][-1]), rel=1e-9)


def test_metrics_csv_equals_tensorboard_and_plots(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _trainer(
        "--train-iters",
        "6",
        "--log-interval",
        "2",
        "--micro-batch-size",
        "2",
        "--log-dir",
        str(tmp_path),
    ).fit()
    rows = read_csv(tmp_path / "metrics.csv")
    assert tuple(rows) == CSV_COLUMNS
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    for column in CSV_COLUMNS[1:]:
        scalars = events.Scalars(f"train/{column}")
        assert [s.step for s in scalars] == [2, 4, 6]
        # TensorBoard stores float32.
        expected = torch.tensor(rows[column], dtype=torch.float32).tolist()
        assert [s.value for s in scalars] == pytest.approx(expected, rel=1e-6, nan_ok=True), column
    paths = plot_run(tmp_path)
    assert [p.name for p in paths] == ["loss.png", "lr.png", "throughput.png"]
    for path in paths:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_fp16_overflow_skips_steps_and_backs_off():
    trainer = _trainer(
        "--train-iters",
        "8",
        "--micro-batch-size",
        "2",
        "--fp16",
        "--initial-loss-scale",
        str(2.0**24),
        "--hysteresis",
        "1",
        "--lr",
        "1e-2",
    )
    before = _params(trainer)
    first = trainer.train_step()
    assert first.skipped and not first.nan and trainer.state.skipped == 1
    assert trainer.scaler.scale == 2.0**23
    assert all(torch.equal(p, before[n]) for n, p in _params(trainer).items())
    assert trainer.scheduler.num_steps == 0  # a skipped step does not advance the schedule
    results = [trainer.train_step() for _ in range(15)]
    assert any(not r.skipped for r in results), "the scale never came down far enough"
    assert trainer.state.nan == 0
    assert any(not torch.equal(p, before[n]) for n, p in _params(trainer).items())


def _poison_once(trainer: Trainer, at_call: int) -> None:
    calls = {"n": 0}

    def hook(module, args, output):
        calls["n"] += 1
        return output * float("nan") if calls["n"] == at_call else output

    trainer.model.register_forward_hook(hook)


def test_nan_stop_policy_names_the_fix():
    trainer = _trainer("--train-iters", "4", "--micro-batch-size", "2")
    _poison_once(trainer, 2)
    trainer.train_step()
    with pytest.raises(NonFiniteLossError, match="--nan-policy skip"):
        trainer.train_step()


def test_nan_skip_policy_counts_and_continues():
    trainer = _trainer("--train-iters", "4", "--micro-batch-size", "2", "--nan-policy", "skip")
    _poison_once(trainer, 2)
    trainer.train_step()
    before = _params(trainer)
    poisoned = trainer.train_step()
    assert poisoned.skipped and poisoned.nan and trainer.state.nan == 1
    assert all(torch.equal(p, before[n]) for n, p in _params(trainer).items())
    after = trainer.train_step()
    assert math.isfinite(after.loss) and not after.skipped


def test_bf16_release_fp32_grad_matches_default_in_the_loop():
    flags = ["--train-iters", "3", "--micro-batch-size", "2", "--bf16", "--lr", "1e-2"]
    default, release = _trainer(*flags), _trainer(*flags, "--release-fp32-grad")
    for _ in range(3):
        assert default.train_step().loss == release.train_step().loss
    for name, p in _params(default).items():
        assert torch.equal(p, _params(release)[name]), name
    assert next(default.model.parameters()).dtype == torch.bfloat16
    assert (
        default.optimizer.persistent_grad_bytes() > 0 == release.optimizer.persistent_grad_bytes()
    )


def test_rampup_grows_the_global_batch():
    trainer = _trainer("--train-iters", "6", "--micro-batch-size", "2", "--global-batch-size", "6",
                       "--rampup-batch-size", "2", "2", "8")  # fmt: skip
    sizes = [trainer.train_step().global_batch for _ in range(5)]
    # 8 ramp samples over (6 - 2) / 2 = 2 increments: +2 every 4 consumed samples.
    assert sizes == [2, 2, 4, 6, 6]
    assert trainer.state.consumed_samples == sum(sizes)


def test_loss_spike_warns(caplog):
    trainer = _trainer("--train-iters", "2", "--spike-factor", "2")
    trainer.state.step = 20
    # Only what _check_spike logs, at every level: building the Trainer logs its MFU peak at
    # INFO, which caplog holds whenever an earlier test left the root logger at INFO.
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="training.loop"):
        for loss in (3.0, 3.1, 2.9):
            trainer._check_spike(loss)
        assert not caplog.records
        trainer._check_spike(9.5)
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert "loss spike 9.5000" in caplog.text


def test_loss_spike_is_not_watched_for_surrogate_losses(caplog, monkeypatch):
    """GRPO/PPO losses have either sign: a ratio to a running mean near 0 or below it "spiked" on
    every step. Those stages are not watched, and a non-positive mean is no baseline."""
    import dataclasses

    trainer = _trainer("--train-iters", "2", "--spike-factor", "2")
    trainer.state.step = 20
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="training.loop"):
        for loss in (-0.02, -0.01, 0.03):  # a negative mean: no ratio to take
            trainer._check_spike(loss)
        assert not caplog.records
        run = dataclasses.replace(trainer.config.run, stage="grpo")
        monkeypatch.setattr(trainer.config, "run", run)
        for loss in (0.01, 0.01, 0.5):  # 50x its mean, but a surrogate: not a spike
            trainer._check_spike(loss)
    assert not caplog.records
