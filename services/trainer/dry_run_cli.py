"""`meshline train ... --dry-run --world-size N`: the command-line side of the dry run.

The training command line is parsed as for a real run, its `--deepspeed-config` mapping table
printed, and `training.dry_run.dry_run` (which builds every distinct rank on the meta device)
reports per-rank parameters and bytes, printed as a table and optionally written as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from models.memory import parse_bytes
from services.trainer.arguments import build_parser, parse_args
from services.trainer.train_config import SECTIONS, TrainConfig
from training import deepspeed_config
from training.dry_run import dry_run, format_table


def main(
    train_argv: list[str],
    world_size: int,
    report_path: str | None,
    device_memory: str | None,
    nproc_per_node: int | None = None,
) -> int:
    """Entry point from `meshline train --dry-run` (`nproc_per_node`: the launcher's flag)."""
    mapping = _deepspeed_mapping(train_argv)
    try:
        config = parse_args(train_argv, read_files=True)
        if mapping is not None:
            print(f"DeepSpeed configuration {deepspeed_config.path_in_argv(train_argv)}:")
            print(deepspeed_config.format_table(mapping, lambda f: _resolved(config, f)))
            deepspeed_config.check_world(mapping, config.dp_size(world_size))
        memory = parse_bytes(device_memory) if device_memory else None
        if nproc_per_node is not None and (nproc_per_node < 1 or world_size % nproc_per_node):
            raise ValueError(
                f"--nproc-per-node {nproc_per_node} does not divide --world-size {world_size}: "
                "the simulated run has world-size / nproc-per-node nodes"
            )
        report = dry_run(config, world_size, memory, nproc_per_node)
    except ValueError as exc:
        if mapping is not None and mapping.refused():
            print(f"DeepSpeed configuration {deepspeed_config.path_in_argv(train_argv)}:")
            print(deepspeed_config.format_table(mapping))
        print(f"meshline train --dry-run: {exc}", file=sys.stderr)
        return 2
    layout = report["layout"]
    total_params = sum(r["unique_parameters"] for r in report["ranks"])
    print(
        f"dry run: {world_size} ranks, TP={layout['tp']} PP={layout['pp']} (virtual "
        f"{layout['virtual_pp']}) DP={layout['dp']} CP={layout['cp']} EP={layout['ep']} "
        f"ZeRO-{layout['zero_stage']} {layout['precision']}; {layout['ranks_built']} distinct "
        "ranks built on the meta device"
    )
    print(f"model parameters (the ranks' unique elements added up): {total_params:,}")
    print(format_table(report))
    fits = report["fits"]
    if fits["ok"] is not None:
        verdict = "fits" if fits["ok"] else "does NOT fit"
        print(
            f"peak rank {fits['peak_rank_bytes'] / 2**30:.2f} GiB {verdict} in "
            f"{fits['device_memory_bytes'] / 2**30:.2f} GiB per device"
        )
    if report_path:
        with open(report_path, "w", encoding="utf-8") as out:
            json.dump(report, out, indent=2)
            out.write("\n")
        print(f"report written to {report_path}")
    return 0 if fits["ok"] in (None, True) else 1


def _deepspeed_mapping(train_argv: list[str]) -> deepspeed_config.Mapping | None:
    """The --deepspeed-config mapping report of a training command line (None without the
    flag, or when the file itself is invalid: parsing reports that)."""
    path = deepspeed_config.path_in_argv(train_argv)
    if path is None:
        return None
    try:
        given = dict(vars(build_parser().parse_args(train_argv)))
        return deepspeed_config.read(path, given)
    except (ValueError, SystemExit):
        return None


def _resolved(config: TrainConfig, field: str) -> Any:
    """The run's resolved value of a training field."""
    for name in SECTIONS:
        section = getattr(config, name)
        if hasattr(section, field):
            return getattr(section, field)
    raise KeyError(field)


def add_flags(parser: argparse.ArgumentParser) -> None:
    """The launcher-level flags of a dry run (`meshline train --help` lists them)."""
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--world-size", type=int, default=None)
    parser.add_argument("--dry-run-report", default=None)
    parser.add_argument("--device-memory", default=None)
