"""Conversion proves itself by default: without any flag a drifting conversion fails and leaves
nothing behind (library, CLI and gRPC service); `--no-verify` / verify=false skips the check; a
model too large for two float32 copies is published with the reason it was not verified."""

from __future__ import annotations

import shutil

import grpc
import pytest
import torch

from checkpoints import megatron_layout
from meshline.common.v1 import operations_pb2
from meshline.converter.v1 import converter_pb2
from services.converter import cli, job
from services.converter.job import ConvertOptions, VerificationFailed, convert
from tests.services.common.helpers import arun
from tests.services.converter.test_servicer import HF, MEGATRON, _convert


def _corrupt_qkv(monkeypatch):
    """A deliberately wrong converter: Megatron's QKV interleave written as plain [q; k; v]."""
    monkeypatch.setattr(
        megatron_layout, "_interleave_qkv", lambda q, k, v, groups: torch.cat([q, k, v])
    )


def _nothing_written(parent, name="out"):
    return not (parent / name).exists() and not list(parent.glob(f".{name}*"))


def test_default_conversion_is_verified_and_drift_fails(llama_dir, tmp_path, monkeypatch):
    good = convert(ConvertOptions("hf", "megatron", llama_dir, tmp_path / "good"))
    assert good.verify is not None and good.verify.max_abs_logit_diff == 0.0
    assert good.verify_skipped is None
    _corrupt_qkv(monkeypatch)
    with pytest.raises(VerificationFailed):
        convert(ConvertOptions("hf", "megatron", llama_dir, tmp_path / "out"))
    assert _nothing_written(tmp_path)
    skipped = convert(ConvertOptions("hf", "megatron", llama_dir, tmp_path / "nv", verify=False))
    assert skipped.verify is None and (tmp_path / "nv").is_dir()


def test_cli_verifies_by_default_and_no_verify_skips(llama_dir, tmp_path, monkeypatch, capsys):
    _corrupt_qkv(monkeypatch)
    base = ["--load-format", "hf", "--save-format", "megatron", "--load-dir", str(llama_dir)]
    assert cli.main([*base, "--save-dir", str(tmp_path / "out")]) == cli.EXIT_VERIFY
    assert _nothing_written(tmp_path)
    assert cli.main([*base, "--save-dir", str(tmp_path / "nv"), "--no-verify"]) == 0
    assert "verify:" not in capsys.readouterr().out


def test_too_large_for_memory_is_published_with_the_reason(llama_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(job, "available_memory_bytes", lambda: 1024)
    report = convert(ConvertOptions("hf", "hf", llama_dir, tmp_path / "out"))
    assert report.verify is None
    assert report.verify_skipped is not None and "--verify" in report.verify_skipped
    forced = convert(ConvertOptions("hf", "hf", llama_dir, tmp_path / "forced", verify=True))
    assert forced.verify is not None and forced.verify.passed


def test_service_verifies_unless_told_not_to(llama_dir, tmp_path, monkeypatch):
    shutil.copytree(llama_dir, tmp_path / "hf")
    _corrupt_qkv(monkeypatch)
    request = converter_pb2.ConvertRequest(
        load_format=HF, save_format=MEGATRON, load_dir=str(tmp_path / "hf"), save_dir=""
    )
    request.save_dir = str(tmp_path / "mg")
    operation, _ = arun(_convert(tmp_path, request), timeout=120)
    assert operation.state == operations_pb2.OPERATION_STATE_FAILED
    assert operation.error.code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
    assert not (tmp_path / "mg").exists()
    request.save_dir, request.verify = str(tmp_path / "nv"), False
    operation, _ = arun(_convert(tmp_path, request), timeout=120)
    assert operation.state == operations_pb2.OPERATION_STATE_SUCCEEDED, operation.error.message
    result = converter_pb2.ConvertResult()
    operation.response.Unpack(result)
    assert not result.HasField("verify")
