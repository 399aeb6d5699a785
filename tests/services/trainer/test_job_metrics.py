"""StreamMetrics carries the objective's own quantities (reward accuracy, DPO margins, GRPO KL),
which the launcher's framed metrics records hold under "objective"; hostile entries are dropped."""

from __future__ import annotations

import math

from services.trainer.job import MAX_OBJECTIVE_METRICS, metrics_message

RECORD = {
    "step": 4, "loss": 0.6, "grad_norm": 1.0, "lr": 1e-3, "tokens_per_s": 10.0, "tflops": 0.1,
    "mfu": 0.0, "mem_gb": 0.0, "skipped": 0, "nan": 0, "elapsed_s": 2.0,
}  # fmt: skip


def test_objective_metrics_reach_the_stream_message():
    objective = {"rewards/chosen": 0.25, "rewards/accuracies": 0.75, "kl": 3}
    message = metrics_message({**RECORD, "objective": objective}, None, tokens_per_step=8)
    assert dict(message.objective_metrics) == {
        "rewards/chosen": 0.25,
        "rewards/accuracies": 0.75,
        "kl": 3.0,
    }
    assert dict(metrics_message(RECORD, None, tokens_per_step=8).objective_metrics) == {}


def test_hostile_objective_entries_are_dropped():
    objective = {
        "ok": 1.0,
        "nan": math.nan,
        "inf": math.inf,
        "x" * 65: 1.0,
        "": 1.0,
        "text": "1.0",
        "nested": {"a": 1},
        **{f"m{i}": float(i) for i in range(100)},
    }
    kept = dict(metrics_message({**RECORD, "objective": objective}, None, 8).objective_metrics)
    assert kept["ok"] == 1.0 and len(kept) == MAX_OBJECTIVE_METRICS
    assert not {"nan", "inf", "x" * 65, "", "text", "nested"} & kept.keys()
    assert dict(metrics_message({**RECORD, "objective": [1, 2]}, None, 8).objective_metrics) == {}
