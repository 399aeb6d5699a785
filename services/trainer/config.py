"""Settings of the trainer gRPC service (not the training config: that is `train_config.py`)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from services.common.data_roots import DataRootsConfig, add_data_root_flag, data_roots_from_args

DEFAULT_PORT = 50052
# auto: Kubernetes workloads (services.trainer.k8s_launcher) inside a cluster, else local torchrun.
LAUNCHERS = ("auto", "local", "kubernetes")


@dataclass
class TrainerServiceConfig(DataRootsConfig):
    """What a trainer server may touch (paths in a request's flags — --data-path, --save,
    --load, ... — lie under `data_roots`) and how large a job it may launch."""

    max_nproc_per_node: int = 8
    """Largest `nproc_per_node` a request may ask for (devices of one node)."""
    max_restarts_limit: int = 10
    """Largest `max_restarts` a request may ask for."""
    launcher: str = "auto"
    """Where jobs run: auto (Kubernetes workloads inside a cluster, else local torchrun), local, kubernetes."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_nproc_per_node < 1:
            raise ValueError(f"--max-nproc-per-node must be >= 1, got {self.max_nproc_per_node}")
        if self.max_restarts_limit < 0:
            raise ValueError(f"--max-restarts-limit must be >= 0, got {self.max_restarts_limit}")
        if self.launcher not in LAUNCHERS:
            raise ValueError(f"--launcher must be one of {LAUNCHERS}, got {self.launcher!r}")


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Adds the trainer service's own flags to its `serve` parser."""
    d = TrainerServiceConfig()
    group = parser.add_argument_group("trainer service")
    add_data_root_flag(group, "paths in training flags")
    group.add_argument(
        "--max-nproc-per-node",
        type=int,
        default=d.max_nproc_per_node,
        help=f"most processes per node a job may ask for (default {d.max_nproc_per_node})",
    )
    group.add_argument(
        "--max-restarts-limit",
        type=int,
        default=d.max_restarts_limit,
        help=f"most restarts after failure a job may ask for (default {d.max_restarts_limit})",
    )
    group.add_argument(
        "--launcher",
        default=d.launcher,
        choices=LAUNCHERS,
        help="where jobs run: kubernetes = training Jobs in this pod's cluster, local = torchrun "
        "beside the server, auto = kubernetes inside a cluster, else local (default auto)",
    )


def from_args(args: argparse.Namespace) -> TrainerServiceConfig:
    """Builds (and so validates) the config from the flags `add_flags` added."""
    roots = data_roots_from_args(args)
    return TrainerServiceConfig(
        data_roots=roots,
        max_nproc_per_node=args.max_nproc_per_node,
        max_restarts_limit=args.max_restarts_limit,
        launcher=args.launcher,
    )
