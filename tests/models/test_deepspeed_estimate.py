"""`meshline estimate --deepspeed-estimate` against DeepSpeed's own estimate functions.

DeepSpeed is the reference: its `estimate_zero2_model_states_mem_needs` /
`estimate_zero3_model_states_mem_needs` (every offload choice), its `model_to_params` counts of
the same built models, and the tables its `*_all_cold` / `*_all_live` functions print, computed
in a child process (importing DeepSpeed sets up its accelerator and loggers: kept out of the test
process). Without DeepSpeed installed (`pip install deepspeed==0.19.8`; with DS_BUILD_OPS unset
it builds no ops, and these functions are pure Python) those tests skip and say so.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from models import build_model
from models.deepspeed_estimate import ModelCounts, model_counts, table, zero2_bytes, zero3_bytes
from models.estimate import main
from models.registry import get_config

REPO = Path(__file__).resolve().parents[2]
DEVICES = [(1, 1), (8, 1), (8, 2), (4, 4), (3, 1), (16, 8)]  # (per node, nodes)
FACTORS = [1.5, 1.0, 2.25]
COUNTS = [  # (total, largest layer): llama2-7B's, a 70B-like, odd small ones
    (6_738_415_616, 131_072_000),
    (68_976_648_192, 262_144_000),
    (57_504, 8_192),
    (1, 1),
    (1_234_567_891, 7_777_777),
]
LIVE_MODELS = ["tiny-llama", "tiny-llama3", "tiny-gpt", "tiny-mixtral", "tiny-qwen2"]
NEEDS_DEEPSPEED = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason="DeepSpeed is not installed (the reference: pip install deepspeed==0.19.8)",
)

REFERENCE = r"""
import contextlib, io, json, sys
from deepspeed.runtime.zero import stage3, stage_1_and_2
from models import build_model
from models.registry import get_config

cases = json.load(sys.stdin)
out = {"zero2": [], "zero3": [], "live": {}, "cold": []}
for total, largest in cases["counts"]:
    for per_node, nodes in cases["devices"]:
        for factor in cases["factors"]:
            for offload in (True, False):
                out["zero2"].append(stage_1_and_2.estimate_zero2_model_states_mem_needs(
                    total, per_node, nodes, offload, factor))
                for params in (True, False):
                    for init in (True, False):
                        out["zero3"].append(stage3.estimate_zero3_model_states_mem_needs(
                            total, largest, per_node, nodes, offload, params, init, factor))
for name in cases["live"]:
    model = build_model(get_config(name), device="cpu")
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        stage3.estimate_zero3_model_states_mem_needs_all_live(model, 8, 2)
        stage_1_and_2.estimate_zero2_model_states_mem_needs_all_live(model, 8, 2)
    out["live"][name] = {
        "zero3": list(stage3.model_to_params(model)),
        "zero2": stage_1_and_2.model_to_params(model),
        "printed": text.getvalue(),
    }
for stage, total, largest, per_node, nodes in cases["cold"]:
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        if stage == 2:
            stage_1_and_2.estimate_zero2_model_states_mem_needs_all_cold(total, per_node, nodes)
        else:
            stage3.estimate_zero3_model_states_mem_needs_all_cold(total, largest, per_node, nodes)
    out["cold"].append(text.getvalue())
print("JSON" + json.dumps(out))
"""

COLD = [(2, 6_738_415_616, 131_072_000, 8, 2), (3, 6_738_415_616, 131_072_000, 8, 2)]


@pytest.fixture(scope="module")
def deepspeed() -> dict:
    """DeepSpeed's answers for the whole grid, from one child process."""
    cases = {
        "counts": COUNTS,
        "devices": DEVICES,
        "factors": FACTORS,
        "live": LIVE_MODELS,
        "cold": COLD,
    }
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", REFERENCE],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("JSON"))
    return json.loads(line[4:])


def _rows(printed: str) -> list[tuple[str, str]]:
    """(per CPU, per GPU) GiB strings of the rows a DeepSpeed table printed."""
    rows = []
    for line in printed.splitlines():
        parts = [p.strip() for p in line.split("|")]
        if len(parts) == 3 and parts[0].endswith("GB"):
            rows.append((f"{float(parts[0][:-2]):.2f}", f"{float(parts[1][:-2]):.2f}"))
    return rows


@NEEDS_DEEPSPEED
def test_formulas_equal_deepspeeds_byte_for_byte(deepspeed: dict) -> None:
    zero2, zero3 = iter(deepspeed["zero2"]), iter(deepspeed["zero3"])
    for total, largest in COUNTS:
        for per_node, nodes in DEVICES:
            for factor in FACTORS:
                for offload in (True, False):
                    got = zero2_bytes(total, per_node, nodes, offload, factor)
                    assert list(got) == next(zero2), (total, per_node, nodes, factor, offload)
                    for params in (True, False):
                        for init in (True, False):
                            mine = zero3_bytes(
                                total, largest, per_node, nodes, offload, params, init, factor
                            )
                            assert list(mine) == next(zero3), (total, per_node, nodes, factor)


@NEEDS_DEEPSPEED
def test_model_counts_equal_deepspeeds_on_built_models(deepspeed: dict) -> None:
    """Tied embeddings counted once, largest module by its own parameters; the meta build
    (what `meshline estimate` counts) gives DeepSpeed's counts of the real model."""
    for name in LIVE_MODELS:
        live = deepspeed["live"][name]
        counts = model_counts(build_model(get_config(name), device="meta"))
        assert [counts.total_params, counts.largest_layer_params] == live["zero3"], name
        assert counts.total_params == live["zero2"], name
        # The per-model variants print what our table gives for those counts (8 x 2 devices).
        ours = [
            (f"{r.cpu_bytes / 2**30:.2f}", f"{r.gpu_bytes / 2**30:.2f}")
            for stage in (3, 2)
            for r in table(stage, counts, 8, 2)
        ]
        assert ours == _rows(live["printed"]), name
    tied = get_config("tiny-llama3")
    assert tied.tie_word_embeddings  # the list above holds a tied model


@NEEDS_DEEPSPEED
def test_cli_table_equals_deepspeeds_all_cold(deepspeed: dict, capsys) -> None:
    """`meshline estimate --deepspeed-estimate` prints DeepSpeed's rows, in its order, for the
    counts of the model it sizes; llama2-7B's counts are the ones given to DeepSpeed."""
    for (stage, total, largest, per_node, nodes), printed in zip(
        COLD, deepspeed["cold"], strict=True
    ):
        argv = ["--model", "llama2-7B", "--bf16", "--zero-stage", str(stage)]
        argv += ["--world-size", str(per_node * nodes), "--devices-per-node", str(per_node)]
        assert main([*argv, "--deepspeed-estimate"]) == 0
        out = capsys.readouterr().out
        assert f"{nodes} node(s) x {per_node} device(s), {total:,} parameters" in out
        assert f"largest layer {largest:,}" in out
        lines = out[out.index("DeepSpeed's estimate") :].splitlines()[2:]
        assert [(line.split()[0], line.split()[1]) for line in lines] == _rows(printed)
        bytes_printed = [(int(line.split()[2]), int(line.split()[3])) for line in lines]
        counts = ModelCounts(total, largest)
        assert bytes_printed == [
            (r.cpu_bytes, r.gpu_bytes) for r in table(stage, counts, per_node, nodes)
        ]


def test_cli_marks_the_flags_row_and_refuses_what_deepspeed_does_not_estimate(capsys) -> None:
    base = ["--model", "tiny-llama", "--world-size", "8", "--deepspeed-estimate"]
    assert main([*base, "--zero-stage", "3", "--cpu-offload"]) == 0
    marked = [x for x in capsys.readouterr().out.splitlines() if "<- these flags" in x]
    assert len(marked) == 1
    assert "offload_param=cpu, offload_optimizer=cpu, zero_init=1" in marked[0]
    assert main([*base, "--zero-stage", "2", "--optimizer-cpu-offload"]) == 0
    marked = [x for x in capsys.readouterr().out.splitlines() if "<- these flags" in x]
    assert len(marked) == 1 and marked[0].endswith("offload_optimizer=cpu   <- these flags")
    refused = {
        "--zero-stage 1": ([*base, "--zero-stage", "1"], "--zero-stage 2 or 3"),
        "TP": (
            [*base, "--zero-stage", "3", "--tensor-model-parallel-size", "2"],
            "drop --tensor-model-parallel-size",
        ),
        "nodes": (
            [*base, "--zero-stage", "3", "--devices-per-node", "3"],
            "do not fill whole nodes of --devices-per-node 3",
        ),
        "factor alone": (
            ["--model", "tiny-llama", "--additional-buffer-factor", "2"],
            "--additional-buffer-factor is DeepSpeed's: add --deepspeed-estimate",
        ),
        "factor <= 0": (
            [*base, "--zero-stage", "3", "--additional-buffer-factor", "0"],
            "--additional-buffer-factor 0.0: must be > 0",
        ),
        "nvme alone": (
            ["--model", "tiny-llama", "--optimizer-nvme"],
            "--optimizer-nvme needs --optimizer-cpu-offload",
        ),
        "param nvme alone": (
            ["--model", "tiny-llama", "--zero-stage", "3", "--cpu-offload", "--param-nvme"],
            "--param-nvme needs --cpu-offload (ZeRO-3 shards on the host) and "
            "--optimizer-cpu-offload",
        ),
        "offload with sgd": (
            ["--model", "tiny-llama", "--optimizer-cpu-offload", "--optimizer", "sgd"],
            "--optimizer sgd has no offloaded form",
        ),
        "auto": (
            ["--model", "tiny-llama", "--auto", "--world-size", "8", "--device-memory", "8GiB",
             "--optimizer-cpu-offload"],
            "drop --optimizer-cpu-offload",
        ),
    }  # fmt: skip
    for name, (argv, message) in refused.items():
        assert main(argv) == 2, name
        assert message in capsys.readouterr().err, name
