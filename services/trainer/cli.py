"""`meshline train`: one process in place, or `--nproc-per-node N` workers through torchrun.

    meshline train --model tiny-llama --mock-data --train-iters 50
    meshline train --nproc-per-node 2 --max-restarts 1 --config run.yaml --lr 1e-4

Launcher flags (torchrun's names): --nproc-per-node, --nnodes, --node-rank, --rdzv-endpoint,
--max-restarts (and torch.distributed.launch's --master-addr/--master-port, the rendezvous of a
multi-node job); every other flag is a training flag (`meshline train --help-train` lists them).
The training flags, every path and tokenizer they name, and the model they define against the
TP/PP layout (`launch_checks`) are checked before any worker starts.

Dry run (no devices, no weights): `meshline train … --dry-run --world-size N
[--nproc-per-node M] [--dry-run-report FILE] [--device-memory 80GiB]` checks the command line,
builds every rank's part of the model on the meta device through the same parallelize code on a
fake process group, and prints per-rank parameters and memory (JSON with --dry-run-report; exit
1 if a rank does not fit --device-memory). --nproc-per-node places the N ranks on N/M nodes, as
the launched run would (`--hsdp` without `--hsdp-shard-size` shards within a node).
"""

from __future__ import annotations

import argparse
import sys

from services.trainer import autotune_launch, dry_run_cli
from services.trainer.arguments import build_parser, parse_args
from services.trainer.launcher import launch
from training.dry_run import check_world_size
from training.launch_checks import check_inputs, check_model_layout, check_paths


def _launcher_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshline train", add_help=False, allow_abbrev=False)
    parser.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=None)
    parser.add_argument("--nnodes", default="1")
    parser.add_argument("--node-rank", "--node_rank", type=int, default=0)
    parser.add_argument("--rdzv-endpoint", "--rdzv_endpoint", default=None)
    parser.add_argument("--max-restarts", "--max_restarts", type=int, default=0)
    # torch.distributed.launch's $DISTRIBUTED_ARGS: where node 0 listens (a c10d rendezvous).
    parser.add_argument("--master-addr", "--master_addr", default=None)
    parser.add_argument("--master-port", "--master_port", default=None)
    parser.add_argument("--help-train", action="store_true")
    dry_run_cli.add_flags(parser)
    return parser


def _autotune_plan(train_argv: list[str], world_size: int) -> int:
    """A dry run of `--autotune` also lists the points the trials would try."""
    config = parse_args(train_argv, read_files=True)
    if config.autotune.autotune:
        try:
            print(autotune_launch.plan_text(config, world_size))
        except ValueError as exc:
            print(f"meshline train: {exc}", file=sys.stderr)
            return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    """Dispatch to an in-process run or a torchrun launch."""
    argv = sys.argv[1:] if argv is None else argv
    if argv in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    launch_args, train_argv = _launcher_parser().parse_known_args(argv)
    if launch_args.rdzv_endpoint is None and launch_args.master_addr and launch_args.nnodes != "1":
        port = launch_args.master_port or "29500"
        launch_args.rdzv_endpoint = f"{launch_args.master_addr}:{port}"
    if launch_args.help_train:
        build_parser().print_help()
        return 0
    if launch_args.dry_run:
        try:
            world_size = check_world_size(launch_args.world_size)
        except ValueError as exc:
            print(f"meshline train: {exc}", file=sys.stderr)
            return 2
        code = dry_run_cli.main(
            train_argv,
            world_size,
            launch_args.dry_run_report,
            launch_args.device_memory,
            launch_args.nproc_per_node,
        )
        return code or _autotune_plan(train_argv, world_size)
    try:
        config = parse_args(train_argv, read_files=True)
    except ValueError as exc:
        print(f"meshline train: {exc}", file=sys.stderr)
        return 2
    in_place = launch_args.nproc_per_node is None and launch_args.nnodes == "1"
    if in_place and not config.autotune.autotune:
        # The worker's imports (the loop, the rollout engine) only where this process trains;
        # a torchrun parent or a dry run never needs them.
        from services.trainer import train

        return train.main(train_argv)
    try:
        nodes = int(str(launch_args.nnodes).split(":")[-1])
        world_size = (launch_args.nproc_per_node or 1) * nodes
        if config.autotune.autotune and launch_args.nnodes != "1":
            raise ValueError(
                "--autotune runs its trials on this node: tune with --nnodes 1 (the same "
                "processes per node), then pass the chosen flags to the multi-node job"
            )
        config.validate(world_size)
        check_paths(config)  # one line before any worker starts
        check_inputs(config)
        check_model_layout(config, world_size)
        if config.autotune.autotune:
            return autotune_launch.run(config, world_size)
        return launch(
            train_argv,
            launch_args.nproc_per_node or 1,
            nnodes=launch_args.nnodes,
            node_rank=launch_args.node_rank,
            rdzv_endpoint=launch_args.rdzv_endpoint,
            max_restarts=launch_args.max_restarts,
        )
    except (ValueError, FileNotFoundError) as exc:
        print(f"meshline train: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
