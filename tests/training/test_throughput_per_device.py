"""tokens/s/dev, TFLOP/s/dev and MFU are per device under every layout.

Rank 0 counts the tokens of its data-parallel replica, which the replica's tensor, pipeline and
context ranks process together: logged per device, each has a share. Before this was divided,
a TP2 run reported twice its devices' throughput and MFU.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from services.trainer.arguments import parse_args
from tests.harness import run_distributed
from tests.parallel.parity import BASE
from training.loop import Trainer
from training.metrics import read_csv

pytestmark = pytest.mark.dist

LAYOUTS = {
    "dp2": [],
    "tp2": ["--tensor-model-parallel-size", "2"],
    "pp2": ["--pipeline-model-parallel-size", "2"],
}


def _logged(rank: int, world_size: int, root: str) -> dict[str, tuple[float, float, float]]:
    """Per layout: (rank 0's step tokens, logged tokens/s over 2 s, logged TFLOP/s)."""
    out = {}
    for name, flags in LAYOUTS.items():
        log_dir = Path(root) / name
        trainer = Trainer(
            parse_args([*BASE, "--train-iters", "1", "--log-dir", str(log_dir), *flags])
        )
        result = trainer.train_step()
        trainer._log([result], 2.0)
        if rank == 0:
            trainer.writer.close()
            rows = read_csv(log_dir / "metrics.csv")
            out[name] = (float(result.tokens), rows["tokens_per_s"][-1], rows["tflops"][-1])
            out[name + "_flops"] = (trainer.flops_per_token, 0.0, 0.0)
    return out


def test_logged_throughput_is_per_device(tmp_path):
    got = run_distributed(_logged, 2, str(tmp_path))[0]
    # DP2: each rank is one replica of one device; TP2 / PP2: one replica on both devices.
    assert got["dp2"][1] == pytest.approx(got["dp2"][0] / 2.0)
    for name in ("tp2", "pp2"):
        tokens, tps, tflops = got[name]
        assert tps == pytest.approx(tokens / 2.0 / 2.0), name
        assert tflops == pytest.approx(tps * got[name + "_flops"][0] / 1e12), name
    # The same global batch on the same two devices: the same per-device rate for equal times.
    assert got["tp2"][1] == pytest.approx(got["dp2"][1])
