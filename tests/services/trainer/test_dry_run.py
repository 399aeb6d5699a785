"""`meshline train --dry-run`: published sizes and layouts built on meta over a fake group."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from models.accounting import count_parameters
from models.memory import parse_bytes
from services.trainer.arguments import parse_args
from training.dry_run import dry_run
from training.setup import build_model_config

REPO = Path(__file__).resolve().parents[3]
COMMON = ["--mock-data", "--micro-batch-size", "1", "--bf16"]
MIXTRAL_8X7B = [
    "--model", "tiny-mixtral", "--num-layers", "32", "--hidden-size", "4096",
    "--num-attention-heads", "32", "--num-query-groups", "8", "--ffn-hidden-size", "14336",
    "--vocab-size", "32000", "--max-position-embeddings", "4096", "--num-experts", "8",
    "--moe-router-topk", "2",
]  # fmt: skip
PUBLISHED = {
    # ModelLink's table: LLaMA2-70B on 64 devices, TP8 x PP8.
    "llama2-70B-tp8-pp8": (
        64,
        ["--model", "llama2-70B", "--seq-length", "4096", "--tensor-model-parallel-size", "8",
         "--pipeline-model-parallel-size", "8", "--sequence-parallel"],
    ),
    # A 65B-class model at TP8 x PP4 x DP2 with the distributed optimizer (ZeRO-1).
    "llama-65B-tp8-pp4-dp2-zero1": (
        64,
        ["--model", "llama-65B", "--seq-length", "2048", "--tensor-model-parallel-size", "8",
         "--pipeline-model-parallel-size", "4", "--use-distributed-optimizer"],
    ),
    # ModelLink's table: Bloom-176B on 96 devices, TP8 x PP12.
    "bloom-176B-tp8-pp12": (
        96,
        ["--model", "bloom-176B", "--seq-length", "2048", "--tensor-model-parallel-size", "8",
         "--pipeline-model-parallel-size", "12", "--sequence-parallel",
         "--decoder-first-pipeline-num-layers", "5", "--decoder-last-pipeline-num-layers", "5"],
    ),
    # Mixtral-8x7B's shape with its 8 experts split over EP8.
    "mixtral-8x7B-ep8": (
        8,
        [*MIXTRAL_8X7B, "--seq-length", "4096", "--expert-model-parallel-size", "8"],
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_published_layout_builds_and_adds_up(name: str) -> None:
    world_size, flags = PUBLISHED[name]
    config = parse_args([*flags, *COMMON])
    report = dry_run(config, world_size, parse_bytes("80GiB"))
    assert report["world_size"] == world_size
    ranks = report["ranks"]
    assert [r["rank"] for r in ranks] == list(range(world_size))
    expected = count_parameters(build_model_config(config))
    assert sum(r["unique_parameters"] for r in ranks) == expected
    for r in ranks:
        b = r["bytes"]
        assert r["parameters"] > 0 and b["parameters"] > 0 and b["activations"] > 0
        assert b["total"] == b["parameters"] + b["gradients"] + b["optimizer"] + b["activations"]
    assert report["fits"]["ok"] is (report["fits"]["peak_rank_bytes"] <= 80 * 2**30)


def test_cli_writes_the_report_and_refuses_a_bad_layout(tmp_path: Path) -> None:
    report_path = tmp_path / "report.json"
    base = [sys.executable, "-m", "services.cli", "train", "--model", "tiny-llama", *COMMON]
    run = subprocess.run(
        [*base, "--seq-length", "32", "--tensor-model-parallel-size", "2",
         "--pipeline-model-parallel-size", "2", "--dry-run", "--world-size", "8",
         "--dry-run-report", str(report_path), "--device-memory", "1GiB"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    report = json.loads(report_path.read_text())
    assert report["layout"]["dp"] == 2 and len(report["ranks"]) == 8
    assert "fits in 1.00 GiB" in run.stdout
    bad = subprocess.run(
        [*base, "--seq-length", "32", "--tensor-model-parallel-size", "3", "--dry-run",
         "--world-size", "6"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert bad.returncode == 2 and "--tensor-model-parallel-size 3" in bad.stderr
    missing = subprocess.run([*base, "--dry-run"], cwd=REPO, capture_output=True, text=True)
    assert missing.returncode == 2 and "--world-size" in missing.stderr


def test_hsdp_dry_run_places_ranks_on_the_launchers_nodes(tmp_path: Path) -> None:
    # --hsdp without --hsdp-shard-size shards within a node: with --nproc-per-node 4, eight
    # ranks are two nodes, so two replicas each sharded four ways, as the launched run builds.
    flags = ["--model", "tiny-llama", "--mock-data", "--seq-length", "32", "--micro-batch-size",
             "1", "--zero-stage", "3", "--hsdp"]  # fmt: skip
    config = parse_args(flags)
    one_node = dry_run(config, 8, None)
    two_nodes = dry_run(config, 8, None, local_world_size=4)
    assert one_node["layout"]["dp_replicate"] == 1 and two_nodes["layout"]["dp_replicate"] == 2
    shard = [r["bytes"]["parameters"] for r in two_nodes["ranks"]]
    assert shard[0] > one_node["ranks"][0]["bytes"]["parameters"]  # a quarter, not an eighth
    report_path = tmp_path / "report.json"
    run = subprocess.run(
        [sys.executable, "-m", "services.cli", "train", *flags, "--dry-run", "--world-size", "8",
         "--nproc-per-node", "4", "--dry-run-report", str(report_path)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert json.loads(report_path.read_text())["layout"]["dp_replicate"] == 2
    uneven = subprocess.run(
        [sys.executable, "-m", "services.cli", "train", *flags, "--dry-run", "--world-size", "8",
         "--nproc-per-node", "3"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert uneven.returncode == 2 and "--nproc-per-node 3 does not divide" in uneven.stderr


@pytest.mark.parametrize(
    ("text", "value"), [("80GiB", 80 * 2**30), ("64 GB", 64 * 10**9), ("1.5TiB", 3 * 2**39)]
)
def test_parse_bytes(text: str, value: int) -> None:
    assert parse_bytes(text) == value
