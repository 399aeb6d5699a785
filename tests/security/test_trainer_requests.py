"""Hostile StartTraining requests against a real TrainerService on localhost (port 0).

Each case asserts containment by its side effect: the marker a payload would create does not
appear, nothing is written outside the root, no job is launched for a refused request, a
directory swapped for a symlink after submission does not receive the checkpoint. Two tiny
mock-data runs (3 steps, 1 process) cover the launched paths; the rest are refused up front.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from meshline.common.v1 import operations_pb2
from meshline.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from tests.security import paths_fixtures
from tests.security.paths_fixtures import list_operations, wait_operation
from tokendata.indexed import IndexedDatasetWriter

# The shared fixtures, bound here so pytest finds them (see paths_fixtures).
root, outside, trainer_server = (
    paths_fixtures.root,
    paths_fixtures.outside,
    paths_fixtures.trainer_server,
)

TINY = [
    *("--model", "tiny-llama", "--mock-data", "--train-iters", "3", "--log-interval", "1"),
    *("--micro-batch-size", "1", "--global-batch-size", "1", "--seq-length", "16"),
    *("--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2"),
    *("--eval-interval", "0"),
]


def _start(address: str, args: list[str], env: dict[str, str] | None = None):
    with grpc.insecure_channel(address) as channel:
        stub = trainer_pb2_grpc.TrainerServiceStub(channel)
        request = trainer_pb2.StartTrainingRequest(args=args, env=env or {})
        return stub.StartTraining(request, timeout=60)


def _refused(address: str, args: list[str], env: dict[str, str] | None = None) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        _start(address, args, env)
    return caught.value


def _sitecustomize_dir(tmp_path: Path, marker: Path) -> Path:
    folder = tmp_path / "evil_site"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    return folder


def _startup_script(tmp_path: Path, marker: Path) -> Path:
    script = tmp_path / "startup.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    return script


def _hostile_env(case: str, tmp_path: Path, marker: Path) -> dict[str, str]:
    touch = f"sh -c 'touch {marker}' %s"
    if case == "pythonpath_sitecustomize":
        return {"PYTHONPATH": str(_sitecustomize_dir(tmp_path, marker))}
    if case == "pythonstartup":
        return {"PYTHONSTARTUP": str(_startup_script(tmp_path, marker)), "PYTHONINSPECT": "1"}
    return {
        "browser_antigravity": {"PYTHONWARNINGS": "ignore::antigravity.x", "BROWSER": touch},
        "ld_preload": {"LD_PRELOAD": str(tmp_path / "evil.so")},
        "bash_env": {"BASH_ENV": str(tmp_path / "evil.sh"), "ENV": str(tmp_path / "evil.sh")},
        "pythonhome": {"PYTHONHOME": str(tmp_path)},
        "nccl_net_plugin": {"NCCL_NET_PLUGIN": str(tmp_path / "evil.so")},
        "launcher_rank": {"RANK": "3", "MASTER_ADDR": "10.0.0.1"},
        "metrics_override": {"MESHLINE_METRICS_STDOUT": "0", "MESHLINE_DATA_ROOTS": "/"},
        "value_command_subst": {"OMP_NUM_THREADS": f"$(touch {marker})"},
        "value_shell_separator": {"NCCL_SOCKET_IFNAME": f"eth0;touch {marker}"},
        "value_newline": {"NCCL_DEBUG": f"INFO\nBROWSER={touch}"},
        "value_library_path": {"PYTORCH_CUDA_ALLOC_CONF": f"backend:{tmp_path}/evil.so"},
    }[case]


ENV_CASES = [
    "browser_antigravity",
    "pythonpath_sitecustomize",
    "pythonstartup",
    "ld_preload",
    "bash_env",
    "pythonhome",
    "nccl_net_plugin",
    "launcher_rank",
    "metrics_override",
    "value_command_subst",
    "value_shell_separator",
    "value_newline",
    "value_library_path",
]


def test_env_payloads_do_run_commands_when_passed_to_python(tmp_path: Path) -> None:
    """The control: given to a Python process, two of the payloads below do run a command."""
    for case in ("browser_antigravity", "pythonpath_sitecustomize"):
        marker = tmp_path / f"control-{case}"
        (tmp_path / case).mkdir()
        env = {**os.environ, **_hostile_env(case, tmp_path / case, marker)}
        subprocess.run([sys.executable, "-c", "pass"], env=env, timeout=60, check=False)
        assert marker.exists(), f"control {case}: the payload did not run; the test is void"


@pytest.mark.parametrize("case", ENV_CASES)
def test_request_env_cannot_configure_the_workers(
    case: str, trainer_server, tmp_path: Path
) -> None:
    marker = tmp_path / "marker"
    env = _hostile_env(case, tmp_path, marker)
    error = _refused(trainer_server.address, TINY, env)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert any(f"env[{name}]" in error.details() for name in env)
    time.sleep(0.5)
    assert not marker.exists()
    assert list_operations(trainer_server.address) == []


def _outside_args(flag: str, root: Path, outside: Path) -> list[str]:
    """Flags that point `flag` outside the root (some by `..`, some through a symlink)."""
    link = root / "escape"
    link.symlink_to(outside, target_is_directory=True)
    (outside / "shard.bin").write_bytes(b"")
    (outside / "shard.idx").write_bytes(b"")
    (outside / "tok.model").write_bytes(b"")
    (outside / "adapter").mkdir()
    (outside / "ckpt").mkdir()
    data = ["--tokenizer-type", "SentencePiece", "--tokenizer-model", str(outside / "tok.model")]
    tiny = [t for t in TINY if t != "--mock-data"]
    return {
        "--data-path": [*tiny, *data, "--data-path", str(link / "shard")],
        "--train-data-path": [*tiny, *data, "--train-data-path", f"{root}/../outside/shard"],
        "--valid-data-path": [
            *tiny,
            *data,
            *("--train-data-path", str(link / "shard"), "--valid-data-path", str(link / "shard")),
        ],
        "--test-data-path": [
            *tiny,
            *data,
            *("--train-data-path", str(link / "shard"), "--test-data-path", str(link / "shard")),
        ],
        "--data-cache-path": [*TINY, "--data-cache-path", str(outside / "cache")],
        "--tokenizer-model": [*TINY, "--tokenizer-model", str(link / "tok.model")],
        "--tokenizer-name-or-path": [*TINY, "--tokenizer-name-or-path", str(outside)],
        "--save": [*TINY, "--save", str(link / "ckpt" / "new")],
        "--load": [*TINY, "--load", str(outside / "ckpt")],
        "--lora-load": [
            *TINY,
            *("--peft-method", "lora", "--lora-target-modules", "q_proj"),
            *("--lora-load", str(outside / "adapter")),
        ],
        "--log-dir": [*TINY, "--log-dir", str(outside / "logs")],
        "--tensorboard-dir": [*TINY, "--tensorboard-dir", str(link / "tb")],
        "--profile-save-path": [*TINY, *PROFILE, "--profile-save-path", str(link / "prof")],
    }[flag]


PROFILE = ["--profile", "--profile-step-start", "0", "--profile-step-end", "1"]


PATH_FLAGS = [
    "--data-path",
    "--train-data-path",
    "--valid-data-path",
    "--test-data-path",
    "--data-cache-path",
    "--tokenizer-model",
    "--tokenizer-name-or-path",
    "--save",
    "--load",
    "--lora-load",
    "--log-dir",
    "--tensorboard-dir",
    "--profile-save-path",
]


@pytest.mark.parametrize("flag", PATH_FLAGS)
def test_every_path_flag_is_confined_to_the_root(
    flag: str, trainer_server, root: Path, outside: Path
) -> None:
    args = _outside_args(flag, root, outside)
    before = sorted(p.relative_to(outside) for p in outside.rglob("*"))
    error = _refused(trainer_server.address, args)
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED, error.details()
    assert list_operations(trainer_server.address) == []
    assert sorted(p.relative_to(outside) for p in outside.rglob("*")) == before


def test_profile_default_dir_is_confined(trainer_server, root: Path) -> None:
    """--profile without --profile-save-path or --log-dir writes to ./profile_dir, in the
    server's working directory: outside the root, so refused like an explicit path."""
    error = _refused(trainer_server.address, [*TINY, *PROFILE])
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "--profile-save-path" in error.details()
    assert list_operations(trainer_server.address) == []


def test_config_file_cannot_point_a_path_outside(trainer_server, root: Path, outside: Path) -> None:
    config = root / "run.yaml"
    config.write_text(f"run:\n  save: {outside / 'ckpt'}\n  log_dir: {outside / 'logs'}\n")
    error = _refused(trainer_server.address, [*TINY, "--config", str(config)])
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert list(outside.iterdir()) == []
    assert list_operations(trainer_server.address) == []


def _write_shard(prefix: Path, documents: int = 4) -> None:
    with IndexedDatasetWriter(prefix, np.int32) as writer:
        for i in range(documents):
            writer.add_document(np.arange(1, 20 + i, dtype=np.int32))


def test_data_shard_symlinked_outside_is_refused(
    trainer_server, root: Path, outside: Path, sentencepiece_model: Path
) -> None:
    """The prefix lies in the root, but its .bin is a symlink to a file outside."""
    _write_shard(outside / "secret")
    _write_shard(root / "corpus")
    (root / "corpus.bin").unlink()
    (root / "corpus.bin").symlink_to(outside / "secret.bin")
    tokenizer = root / "tok.model"
    tokenizer.write_bytes(sentencepiece_model.read_bytes())
    args = [t for t in TINY if t != "--mock-data"]
    args += ["--data-path", str(root / "corpus"), "--tokenizer-type", "SentencePiece"]
    args += ["--tokenizer-model", str(tokenizer)]
    error = _refused(trainer_server.address, args)
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert list_operations(trainer_server.address) == []


def test_default_cache_dir_symlinked_outside_is_refused(
    trainer_server, root: Path, outside: Path, sentencepiece_model: Path
) -> None:
    """No --data-cache-path: the index cache goes to cache/ beside the shard, here a symlink."""
    (root / "data").mkdir()
    _write_shard(root / "data" / "corpus")
    (root / "data" / "cache").symlink_to(outside, target_is_directory=True)
    tokenizer = root / "tok.model"
    tokenizer.write_bytes(sentencepiece_model.read_bytes())
    args = [t for t in TINY if t != "--mock-data"]
    args += ["--data-path", str(root / "data" / "corpus"), "--tokenizer-type", "SentencePiece"]
    args += ["--tokenizer-model", str(tokenizer)]
    error = _refused(trainer_server.address, args)
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "--data-cache-path" in error.details()
    assert list(outside.iterdir()) == []
    assert list_operations(trainer_server.address) == []


def test_tokenizer_folder_with_a_symlink_outside_is_refused(
    trainer_server, root: Path, outside: Path
) -> None:
    secret = outside / "secret.json"
    secret.write_text('{"model": "secret"}')
    folder = root / "tokenizer"
    folder.mkdir()
    (folder / "tokenizer.json").symlink_to(secret)
    args = [*TINY, "--tokenizer-name-or-path", str(folder)]
    error = _refused(trainer_server.address, args)
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert list_operations(trainer_server.address) == []


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--lr", "nan"), ("--clip-grad", "inf"), ("--adam-eps", "nan"), ("--min-lr", "-inf")],
)
def test_non_finite_numbers_are_refused_before_launch(
    flag: str, value: str, trainer_server, root: Path
) -> None:
    save = root / "ckpt"
    error = _refused(trainer_server.address, [*TINY, "--save", str(save), flag, value])
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert flag in error.details()
    assert not save.exists()
    assert list_operations(trainer_server.address) == []


@pytest.mark.parametrize("damage", ["missing", "bad_magic", "truncated", "empty_idx"])
def test_missing_or_corrupt_shard_is_refused_before_launch(
    damage: str, trainer_server, root: Path, sentencepiece_model: Path
) -> None:
    prefix = root / "corpus"
    _write_shard(prefix)
    idx = root / "corpus.idx"
    if damage == "missing":
        (root / "corpus.bin").unlink()
    elif damage == "bad_magic":
        idx.write_bytes(b"NOTANIDX" + idx.read_bytes()[8:])
    elif damage == "truncated":
        idx.write_bytes(idx.read_bytes()[:40])
    else:
        idx.write_bytes(b"")
    tokenizer = root / "tok.model"
    tokenizer.write_bytes(sentencepiece_model.read_bytes())
    save = root / "ckpt"
    args = [t for t in TINY if t != "--mock-data"]
    args += ["--data-path", str(prefix), "--tokenizer-type", "SentencePiece"]
    args += ["--tokenizer-model", str(tokenizer), "--save", str(save)]
    error = _refused(trainer_server.address, args)
    expected = (
        grpc.StatusCode.NOT_FOUND if damage == "missing" else grpc.StatusCode.INVALID_ARGUMENT
    )
    assert error.code() == expected, error.details()
    assert "--data-path" in error.details()
    assert not save.exists()
    assert list_operations(trainer_server.address) == []


def test_missing_tokenizer_is_not_found_before_launch(trainer_server, root: Path) -> None:
    _write_shard(root / "corpus")
    args = [t for t in TINY if t != "--mock-data"]
    args += ["--data-path", str(root / "corpus"), "--tokenizer-type", "SentencePiece"]
    args += ["--tokenizer-model", str(root / "nope.model")]
    error = _refused(trainer_server.address, args)
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert "--tokenizer-model" in error.details()
    assert list_operations(trainer_server.address) == []


@pytest.mark.slow
def test_directory_swapped_for_a_symlink_after_submission_gets_no_checkpoint(
    trainer_server, root: Path, outside: Path
) -> None:
    """--save was inside the root when checked; the run directory then becomes a symlink out."""
    run = root / "run"
    run.mkdir()
    started = _start(trainer_server.address, [*TINY, "--save", str(run / "ckpt")])
    # torchrun takes seconds to start its worker: swap before the worker reaches its paths.
    run.rename(root / "run.orig")
    run.symlink_to(outside, target_is_directory=True)
    operation = wait_operation(trainer_server.address, started.operation.name)
    assert operation.state == operations_pb2.OPERATION_STATE_FAILED
    assert operation.error.code == grpc.StatusCode.PERMISSION_DENIED.value[0], operation.error
    assert list(outside.iterdir()) == []


@pytest.mark.slow
def test_allowed_env_runs_with_resolved_paths_only(
    trainer_server, root: Path, sentencepiece_model: Path
) -> None:
    """A permitted request on real shards runs; its workers get the resolved paths (data,
    tokenizer, --save), not the alias given, which is repointed right after submission."""
    (root / "real").mkdir()
    (root / "alias").symlink_to(root / "real", target_is_directory=True)
    _write_shard(root / "real" / "corpus", documents=8)
    shutil.copy(sentencepiece_model, root / "real" / "tok.model")
    alias = root / "alias"
    args = [t for t in TINY if t != "--mock-data"]
    args += ["--data-path", str(alias / "corpus"), "--split", "1,0,0"]
    args += ["--tokenizer-type", "SentencePiece", "--tokenizer-model", str(alias / "tok.model")]
    args += ["--save", str(alias / "ckpt")]
    env = {"OMP_NUM_THREADS": "1", "NCCL_DEBUG": "WARN", "GLOO_SOCKET_IFNAME": "lo"}
    started = _start(trainer_server.address, args, env)
    # Repoint the alias after submission: the job must keep writing where it was resolved to.
    (root / "elsewhere").mkdir()
    (root / "alias").unlink()
    (root / "alias").symlink_to(root / "elsewhere", target_is_directory=True)
    operation = wait_operation(trainer_server.address, started.operation.name)
    assert operation.state == operations_pb2.OPERATION_STATE_SUCCEEDED, operation.error.message
    result = trainer_pb2.TrainingResult()
    operation.response.Unpack(result)
    assert result.checkpoint_path.startswith(str(root / "real" / "ckpt"))
    assert (root / "real" / "ckpt" / "latest").read_text().strip() == "3"
    assert list((root / "elsewhere").iterdir()) == []


def test_meshline_train_preflights_its_inputs_before_launching(root: Path) -> None:
    """The CLI shares the preflight: a missing shard ends it with exit code 2, nothing started."""
    from services.trainer import cli

    save = root / "ckpt"
    args = ["--nproc-per-node", "1", *(t for t in TINY if t != "--mock-data")]
    args += ["--data-path", str(root / "absent"), "--tokenizer-type", "SentencePiece"]
    args += ["--tokenizer-model", str(root / "absent.model"), "--save", str(save)]
    assert cli.main(args) == 2
    assert not save.exists()
