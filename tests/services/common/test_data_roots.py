"""DataRootsConfig and --data-root (services/common/data_roots.py), the same in every job service."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

from services.common.data_roots import (
    DataRootsConfig,
    add_data_root_flag,
    data_roots_from_args,
)
from services.common.errors import InvalidArgument, PermissionDenied
from services.converter import config as converter_config
from services.evaluator import config as evaluator_config
from services.preprocess import config as preprocess_config
from services.trainer import config as trainer_config

SERVICES = {
    "preprocess": (preprocess_config, preprocess_config.PreprocessServiceConfig),
    "trainer": (trainer_config, trainer_config.TrainerServiceConfig),
    "converter": (converter_config, converter_config.ConverterServiceConfig),
    "evaluator": (evaluator_config, evaluator_config.EvaluatorServiceConfig),
}


def test_roots_are_resolved_and_checked(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert DataRootsConfig(data_roots=(tmp_path / "link",)).data_roots == (
        (tmp_path / "real").resolve(),
    )
    with pytest.raises(ValueError, match="--data-root: give at least one directory"):
        DataRootsConfig(data_roots=())
    with pytest.raises(ValueError, match=r"--data-root '.*missing' is not an existing directory"):
        DataRootsConfig(data_roots=(tmp_path / "missing",))


def test_resolve_confines_request_paths(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "data").mkdir(parents=True)
    (root / "escape").symlink_to(tmp_path)
    config = DataRootsConfig(data_roots=(root,))
    assert config.resolve(str(root / "data" / ".." / "data"), "input") == (root / "data").resolve()
    assert config.resolve(str(root / "new" / "out"), "save_dir") == root.resolve() / "new" / "out"
    for escape in (str(root / ".."), str(root / "escape" / "x"), "/etc/passwd"):
        with pytest.raises(PermissionDenied, match=r"^input: .*outside the allowed roots"):
            config.resolve(escape, "input")
    with pytest.raises(InvalidArgument, match="input"):
        config.resolve("", "input")
    assert config.under_roots(root.resolve() / "a") and not config.under_roots(tmp_path)


def test_flag_is_repeatable_and_defaults_to_the_working_directory(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_data_root_flag(parser, "checkpoint paths")
    args = parser.parse_args(["--data-root", str(tmp_path), "--data-root=/"])
    assert data_roots_from_args(args) == (tmp_path, Path("/"))
    assert data_roots_from_args(parser.parse_args([])) == (Path.cwd(),)
    assert "directory that checkpoint paths must lie under" in parser.format_help()


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_every_job_service_takes_data_roots_the_same_way(
    service: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module, config_class = SERVICES[service]
    assert issubclass(config_class, DataRootsConfig)
    parser = argparse.ArgumentParser()
    module.add_flags(parser)
    (tmp_path / "a").mkdir()
    config = module.from_args(
        parser.parse_args(["--data-root", str(tmp_path / "a"), "--data-root", str(tmp_path)])
    )
    assert config.data_roots == ((tmp_path / "a").resolve(), tmp_path.resolve())
    with pytest.raises(PermissionDenied):
        config.resolve(os.path.dirname(tmp_path), "load_dir")
    with pytest.raises(ValueError, match="is not an existing directory"):
        module.from_args(parser.parse_args(["--data-root", str(tmp_path / "missing")]))
    monkeypatch.chdir(tmp_path / "a")
    assert module.from_args(parser.parse_args([])).data_roots == ((tmp_path / "a").resolve(),)
