"""`--compile` (per-block torch.compile, inductor on CPU) trains like eager."""

from __future__ import annotations

import pytest

from services.trainer.arguments import parse_args
from training.loop import Trainer

FLAGS = [
    "--model",
    "tiny-llama",
    "--mock-data",
    "--seq-length",
    "32",
    "--micro-batch-size",
    "4",
    "--eval-interval",
    "0",
    "--seed",
    "5",
    "--train-iters",
    "20",
    "--lr",
    "3e-3",
]


def _losses(*extra: str) -> list[float]:
    trainer = Trainer(parse_args([*FLAGS, *extra]))
    return [trainer.train_step().loss for _ in range(20)]


@pytest.mark.slow
@pytest.mark.parametrize("recompute", [(), ("--recompute-granularity", "full")])
def test_compiled_layers_train_like_eager(recompute: tuple[str, ...]) -> None:
    eager = _losses(*recompute)
    compiled = _losses("--compile", *recompute)
    # Inductor fuses and reorders fp32 arithmetic: the same math to rounding, which Adam's
    # 20 steps amplify a little; a wrong graph (a dropped op, stale weights) is off by far more.
    assert compiled == pytest.approx(eager, rel=2e-4, abs=2e-4)
    assert compiled[-1] < compiled[0] - 0.2


def test_compile_refuses_adaptive_recompute() -> None:
    with pytest.raises(ValueError, match="--compile"):
        parse_args([*FLAGS, "--compile", "--auto-recompute-device-size", "1000"])


@pytest.mark.slow
def test_compiled_layer_is_one_graph() -> None:
    """Each decoder layer traces as one graph: backend choice and device probing happen before
    compile (kernels.registry.preload), so no import or probe splits the layer (on a GPU one such
    graph break per layer made --compile slower than eager)."""
    import torch
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    trainer = Trainer(parse_args([*FLAGS, "--compile", "--train-iters", "2"]))
    trainer.train_step()
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] >= 1
