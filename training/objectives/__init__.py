"""Training objectives, one registry keyed by the string the CLI and the config use (--stage).

`sft` (next-token cross entropy) is the only one so far. A reward model (`rm`: a scalar head
scored on chosen/rejected pairs) or DPO (`dpo`: chosen/rejected plus a frozen reference model)
is a new `Objective` subclass in its own file, registered here: it reads its pairs from the batch,
says what it counts (pairs) and returns the summed loss with any extra metrics. Adding one also
adds its name to `RunSection.stage`'s choices, which is what lets `--stage NAME` through.
"""

from __future__ import annotations

from training.objectives.base import ForwardContext, Objective, ObjectiveOutput
from training.objectives.sft import NextTokenLoss

__all__ = ["OBJECTIVES", "ForwardContext", "Objective", "ObjectiveOutput", "build_objective"]

OBJECTIVES: dict[str, type[Objective]] = {cls.name: cls for cls in (NextTokenLoss,)}
"""Objective classes by name."""


def build_objective(name: str) -> Objective:
    """The registered objective `name` (ValueError naming --stage and the known ones otherwise)."""
    if name not in OBJECTIVES:
        raise ValueError(
            f"--stage {name!r} is not a training objective; known: {sorted(OBJECTIVES)}"
        )
    return OBJECTIVES[name]()
