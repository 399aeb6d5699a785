"""`meshline`: one console script with a subcommand per pipeline stage.

Each subcommand lives in its own module and owns its flags (`meshline train --help`); this file
only dispatches, so `meshline --help` stays fast (no torch import) and a stage whose module has not
landed yet says which issue brings it instead of pretending to work.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass

SERVICES = ("preprocess", "trainer", "converter", "inference", "evaluator")


@dataclass(frozen=True)
class Subcommand:
    module: str
    summary: str
    issue: int
    precheck: str | None = None
    """Torch-free module whose `precheck(argv) -> exit code | None` runs before `module` is
    imported: a parallel layout the model's config rules out is refused in well under a second."""
    routes: tuple[tuple[str, str], ...] = ()
    """(flag, module): a command line holding the flag runs that module instead of `module`
    (a library command whose flag needs a service, e.g. `estimate --trial`)."""


SUBCOMMANDS: dict[str, Subcommand] = {
    "preprocess": Subcommand(
        "services.preprocess.cli",
        "tokenise corpora / instruction data into .bin/.idx or Arrow shards",
        4,
    ),
    "train": Subcommand(
        "services.trainer.cli",
        "train or fine-tune a model (single or multi-process)",
        5,
        "services.trainer.precheck",
    ),
    "convert": Subcommand(
        "services.converter.cli",
        "convert and reshard checkpoints (HF, native, Megatron, GGUF)",
        7,
        "services.converter.precheck",
    ),
    "generate": Subcommand(
        "services.inference.cli", "generate text from a checkpoint (or --chat)", 8
    ),
    "evaluate": Subcommand(
        "services.evaluator.cli", "score a model on BoolQ, MMLU, GSM8K, HumanEval, ...", 9
    ),
    "estimate": Subcommand(
        "models.estimate",
        "per-device memory estimate for a model and parallel layout",
        3,
        # Measuring the ranked layouts launches training jobs: the trainer's composition.
        routes=(("--trial", "services.estimate_trial"),),
    ),
    "plot": Subcommand(
        "services.trainer.plot", "draw loss / lr / throughput curves from a run's metrics.csv", 5
    ),
    "serve": Subcommand("services.serve", "run one service (or `all`) as a gRPC server", 2),
}


def _usage() -> str:
    width = max(len(name) for name in SUBCOMMANDS)
    lines = [
        "usage: meshline <command> [flags]   (meshline <command> --help for its flags)",
        "",
        "commands:",
        *(f"  {name:<{width}}  {sub.summary}" for name, sub in SUBCOMMANDS.items()),
        "",
        f"services for `meshline serve`: {', '.join(SERVICES)}, all",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    sub = SUBCOMMANDS.get(name)
    if sub is None:
        print(f"meshline: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    if sub.precheck is not None:
        code = importlib.import_module(sub.precheck).precheck(rest)
        if code is not None:
            return int(code)
    target = next(
        (
            module
            for flag, module in sub.routes
            if any(arg == flag or arg.startswith(flag + "=") for arg in rest)
        ),
        sub.module,
    )
    try:
        module = importlib.import_module(target)
    except ModuleNotFoundError as exc:
        if exc.name is not None and target.startswith(exc.name):
            print(
                f"meshline {name}: arrives with issue #{sub.issue} ({sub.summary}); "
                "it is not part of this build yet",
                file=sys.stderr,
            )
            return 2
        raise
    result = module.main(rest)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
