"""A training request's --reward-model is a path like any other: confined to the data roots."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.errors import PermissionDenied
from services.trainer.arguments import parse_args
from services.trainer.request_paths import argv_from_config, confine_config


def test_reward_model_outside_the_roots_is_refused(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "rm").mkdir(parents=True)
    outside.mkdir()
    inside = confine_config(parse_args(["--reward-model", str(root / "rm")]), [root])
    assert inside.rl.reward_model == str((root / "rm").resolve())
    assert "--reward-model" in argv_from_config(inside)
    with pytest.raises(PermissionDenied, match="--reward-model"):
        confine_config(parse_args(["--reward-model", str(outside)]), [root])
    (root / "link").symlink_to(outside)
    with pytest.raises(PermissionDenied):
        confine_config(parse_args(["--reward-model", str(root / "link")]), [root])
