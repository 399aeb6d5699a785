"""A file written tensor by tensor (torch_stream) loads like torch.save's, and the Megatron writer
holds no tensor between units: each shard is on disk once its unit has been written."""

from __future__ import annotations

import argparse

import pytest
import torch

from checkpoints.hf_format import HFSource
from checkpoints.megatron_writer import MegatronSink
from checkpoints.torch_stream import StreamingTorchFile, TensorRef
from checkpoints.units import units
from models.config import ModelConfig


def test_streamed_file_loads_like_torch_save(tmp_path):
    tensors = {
        "f32": torch.randn(3, 5),
        "bf16": torch.randn(7).to(torch.bfloat16),
        "f16": torch.randn(2, 2).half(),
        "i64": torch.arange(6).reshape(2, 3),
        "empty": torch.empty(0, 4),
    }
    stream = StreamingTorchFile(tmp_path / "streamed.pt")
    refs = {name: stream.add(t) for name, t in tensors.items()}
    stream.close({"args": argparse.Namespace(tp=2), "model": {"inner": refs}, "version": 3.0})
    with torch.serialization.safe_globals([argparse.Namespace]):
        for mmap in (False, True):
            state = torch.load(tmp_path / "streamed.pt", weights_only=True, mmap=mmap)
            assert state["args"].tp == 2 and state["version"] == 3.0
            for name, tensor in tensors.items():
                loaded = state["model"]["inner"][name]
                assert loaded.dtype == tensor.dtype and torch.equal(loaded, tensor), name


def test_an_abandoned_file_does_not_load(tmp_path):
    stream = StreamingTorchFile(tmp_path / "partial.pt")
    stream.add(torch.ones(4))
    stream.abandon()
    with pytest.raises(RuntimeError):
        torch.load(tmp_path / "partial.pt", weights_only=True)


def test_megatron_sink_holds_only_references_between_units(llama_dir, tmp_path):
    source = HFSource(llama_dir)
    config: ModelConfig = source.config
    sink = MegatronSink(tmp_path, config, torch.float32, [], tp=2, pp=2)
    for unit in units(config):
        sink.write_unit(unit, source.read_unit(unit))
        for chunks in sink._pending.values():
            for held in chunks.values():
                assert all(isinstance(r, TensorRef) for refs in held.values() for r in refs)
    files = sink.finish()
    assert len([f for f in files if f.endswith("model_optim_rng.pt")]) == 4
