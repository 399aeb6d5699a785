"""`meshline estimate` against `meshline train --dry-run`: the same model-state bytes, exactly.

The estimate derives each rank's elements from the parameter shapes and the TP plan
(models.model_states); the dry run counts them on the model the trainer's parallelize code
builds for that rank. For every registered model, on a grid of layouts that exercises each
precision mode (fp32, master, autocast/ZeRO-1, FSDP2/ZeRO-3) with TP, SP and PP, both must give
the same parameter, gradient and optimizer bytes for every rank.
"""

from __future__ import annotations

import pytest

from models.memory import rank_state_bytes
from models.registry import get_config, list_configs
from parallel.parallel_dims import build_dims
from services.trainer.arguments import parse_args
from training.dry_run import _axis_sizes, _layout, dry_run
from training.setup import build_model_config

GRID = {
    # name: (world size, flags)
    "tp2-pp2-bf16": (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--bf16"]),
    "dp2-zero1-bf16": (2, ["--use-distributed-optimizer", "--bf16"]),
    "tp2-dp2-zero3-bf16": (4, ["--tensor-model-parallel-size", "2", "--zero-stage", "3", "--bf16"]),
    "pp2-dp2-fp32": (4, ["--pipeline-model-parallel-size", "2"]),
}  # fmt: skip
MODELS = list_configs()


def _flags(name: str, layout: list[str]) -> list[str]:
    config = get_config(name)
    flags = ["--model", name, "--mock-data", "--seq-length", "64", "--micro-batch-size", "1"]
    if config.embedding_layernorm and "--tensor-model-parallel-size" in layout:
        flags.append("--sequence-parallel")  # such models need SP under TP
    if "--tensor-model-parallel-size" in layout and config.vocab_size % 2:
        # GPT-2's 50257 tokens do not split over TP 2 (refused by name); Megatron pads the
        # vocabulary to a multiple of 128 x TP, which --vocab-size states here.
        flags += ["--vocab-size", str(-(-config.vocab_size // 256) * 256)]
    return [*flags, *layout]


def _splits(name: str, layout: str) -> bool:
    """Whether the layout's TP size divides the model's heads (gpt2-1.5B's 25 heads do not: that
    layout is refused by name, tests/services/test_layout_checks_first.py)."""
    flags = GRID[layout][1]
    tp = (
        int(flags[flags.index("--tensor-model-parallel-size") + 1])
        if "--tensor-model-parallel-size" in flags
        else 1
    )
    return get_config(name).num_attention_heads % tp == 0


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "layout"), [(n, layout) for n in MODELS for layout in GRID if _splits(n, layout)]
)
def test_estimate_equals_dry_run(name: str, layout: str) -> None:
    world_size, flags = GRID[layout]
    config = parse_args(_flags(name, flags))
    report = dry_run(config, world_size, None)
    model_config = build_model_config(config)
    estimate_layout = _layout(config, world_size)
    sizes = _axis_sizes(build_dims(config, world_size))
    seen = set()
    for rank in report["ranks"]:
        key = (rank["pp"], rank["dp"], rank["cp"])
        if key in seen:
            continue
        seen.add(key)
        shard_index = rank["dp"] * sizes["cp"] + rank["cp"]
        elements, states = rank_state_bytes(model_config, estimate_layout, rank["pp"], shard_index)
        got = rank["bytes"]
        assert elements == rank["parameters"], (rank["rank"], elements, rank["parameters"])
        assert (states.parameters, states.gradients, states.optimizer) == (
            got["parameters"],
            got["gradients"],
            got["optimizer"],
        ), rank["rank"]


@pytest.mark.parametrize(
    "flags",
    [
        ["--optimizer-cpu-offload"],
        ["--optimizer-cpu-offload", "--optimizer-nvme-path", "SWAP"],
        ["--cpu-offload", "--optimizer-cpu-offload", "--optimizer-nvme-path", "SWAP"],
        ["--cpu-offload", "--optimizer-cpu-offload", "--param-nvme-path", "PSWAP"],
        ["--cpu-offload", "--optimizer-cpu-offload", "--optimizer-nvme-path", "SWAP",
         "--param-nvme-path", "PSWAP"],
    ],
)  # fmt: skip
def test_dry_run_places_offloaded_bytes_as_the_estimate(flags: list[str], tmp_path) -> None:
    """The dry run moves the offloaded bytes to `host` and `nvme` as the estimate does (on this
    CPU-only process the offloaded step stages nothing: `staged_offload=False`)."""
    swaps = {"SWAP": str(tmp_path / "swap"), "PSWAP": str(tmp_path / "params")}
    flags = [swaps.get(f, f) for f in flags]
    config = parse_args([*_flags("tiny-llama", ["--zero-stage", "3"]), *flags])
    report = dry_run(config, 2, None)
    model_config = build_model_config(config)
    layout = _layout(config, 2)
    assert layout.optimizer_offload == ("nvme" if "--optimizer-nvme-path" in flags else "cpu")
    layout.staged_offload = False
    for rank in report["ranks"]:
        _, states = rank_state_bytes(model_config, layout, rank["pp"], rank["dp"])
        got = rank["bytes"]
        assert (states.parameters, states.gradients, states.optimizer) == (
            got["parameters"],
            got["gradients"],
            got["optimizer"],
        )
        assert (states.host, states.nvme) == (got["host"], got["nvme"])
        moments = 8 * rank["parameters"] if "--optimizer-nvme-path" in flags else 0
        shards = 4 * rank["parameters"] if "--param-nvme-path" in flags else 0
        assert got["nvme"] == moments + shards
