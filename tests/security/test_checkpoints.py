"""Hostile checkpoints: every payload tries to create a marker file (or to pull foreign data into
the model); each test asserts the marker is absent / the model untouched AND that the load was
refused. Reached through the entry points users reach: the trainer's resume path
(`CheckpointManager.load`, i.e. `StartTraining --load`), the inference loader (`read_state`, i.e.
`meshline serve inference --load` and `StartEvaluation` with a local model), the converter's
sources and its gRPC service on localhost (`Convert`).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
import struct
from pathlib import Path
from typing import ClassVar

import grpc
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

from checkpoints import deepspeed_format, megatron_format
from checkpoints.fsdp_format import FSDPSource
from checkpoints.lora import LoraAdapter
from checkpoints.safe_reader import SafeFileSystemReader
from checkpoints.torch_files import RefusedGlobals, load_weights_only
from engine.loading import read_state
from meshline.common.v1 import checkpoint_pb2
from meshline.converter.v1 import converter_pb2
from models.registry import get_config
from services.converter.job import ConvertOptions, convert
from tests.parallel.test_data_parallel_model import build_optimizer, build_tiny_model
from tests.security.grpc_convert import convert_over_grpc
from tests.services.converter.conftest import hf_llama_gqa, save_hf
from training.checkpoint import CheckpointManager, TrainState


@pytest.fixture
def marker(tmp_path: Path) -> Path:
    """The file every payload tries to create."""
    return tmp_path / "pwned"


class _Reduce:
    """Pickles as `func(*args)`: what a malicious file asks the unpickler to call."""

    def __init__(self, func: object, args: tuple) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> tuple:
        return self.func, self.args


def _touch_cmd(marker: Path) -> str:
    return f"touch {marker}"


def _unicode(text: str) -> bytes:
    raw = text.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw  # BINUNICODE


def _stack_global(module: str, name: str, arg: str) -> bytes:
    """Protocol 4: module, name, STACK_GLOBAL, then call it with one string argument."""
    return b"\x80\x04" + _unicode(module) + _unicode(name) + b"\x93" + _unicode(arg) + b"\x85R."


def _payloads(marker: Path) -> dict[str, bytes]:
    cmd = _touch_cmd(marker)
    code = f"open({str(marker)!r}, 'w').close()"
    text = cmd.encode()
    return {
        **{
            f"os.system-protocol{p}": pickle.dumps(_Reduce(os.system, (cmd,)), protocol=p)
            for p in (0, 2, 4, 5)
        },
        "posix.system-GLOBAL": b"cposix\nsystem\n(V" + text + b"\ntR.",
        "builtins.eval": pickle.dumps(_Reduce(eval, (code,)), protocol=2),
        "builtins.exec": pickle.dumps(_Reduce(exec, (code,)), protocol=4),
        "builtins.getattr-of-__import__": (
            b"cbuiltins\ngetattr\n(cbuiltins\n__import__\n(Vos\ntRVsystem\ntR(V" + text + b"\ntR."
        ),
        "builtins.__import__-first": (
            b"cbuiltins\n__import__\np0\n0cbuiltins\ngetattr\n(g0\n(Vos\ntRVsystem\ntR(V"
            + text
            + b"\ntR."
        ),
        "subprocess.Popen": pickle.dumps(_Reduce(__import__("subprocess").Popen, (cmd,)), 2),
        # The report's path: an allowed module prefix, the attribute traversed by a dotted name.
        "dcp.filesystem.os.system-STACK_GLOBAL": _stack_global(
            "torch.distributed.checkpoint.filesystem", "os.system", cmd
        ),
        "dcp.metadata.os.system-GLOBAL-proto4": (
            b"\x80\x04ctorch.distributed.checkpoint.metadata\nos.system\n"
            + _unicode(cmd)
            + b"\x85R."
        ),
        "torch.os.system-STACK_GLOBAL": _stack_global("torch", "os.system", cmd),
        "persistent-id": b"\x80\x02" + b"P" + text + b"\n.",
    }


PAYLOAD_NAMES = list(_payloads(Path("/x")))


def _fresh_state(seed: int = 0) -> TrainState:
    model = build_tiny_model(seed)
    return TrainState(model, build_optimizer(model))


def _params(state: TrainState) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in state.model.state_dict().items()}


@pytest.fixture
def trainer_step(tmp_path: Path) -> Path:
    """A real trainer checkpoint (step 1) of the tiny model."""
    CheckpointManager(tmp_path / "save").save(1, _fresh_state(seed=1))
    return tmp_path / "save" / "step-000001"


def _resume_refused(save_dir: Path) -> TrainState:
    """`--load` of `save_dir` must fail; returns the state it was loading into."""
    state = _fresh_state(seed=0)
    with pytest.raises((ValueError, RuntimeError)):
        CheckpointManager(save_dir).load("latest", state)
    return state


@pytest.mark.parametrize("payload", PAYLOAD_NAMES)
def test_trainer_resume_refuses_metadata_payload(payload, trainer_step, marker):
    (trainer_step / ".metadata").write_bytes(_payloads(marker)[payload])
    state = _resume_refused(trainer_step.parent)
    assert not marker.exists()
    assert all(torch.equal(v, _params(_fresh_state(0))[k]) for k, v in _params(state).items())


def test_payload_after_allowed_objects_is_refused_before_any_is_built(
    trainer_step, marker, monkeypatch
):
    """A hostile global nested deep inside otherwise valid metadata: refused by the checking
    pass, before a single real metadata object (TensorProperties.__setstate__) is built."""
    real = pickle.loads((trainer_step / ".metadata").read_bytes())
    real.storage_meta.checkpoint_id = _Reduce(os.system, (_touch_cmd(marker),))
    (trainer_step / ".metadata").write_bytes(pickle.dumps(real, protocol=4))
    built = []
    original = dcp_metadata.TensorProperties.__setstate__
    monkeypatch.setattr(
        dcp_metadata.TensorProperties,
        "__setstate__",
        lambda self, state: (built.append(1), original(self, state))[1],
    )
    _resume_refused(trainer_step.parent)
    assert not marker.exists() and built == []


def _evil_bytes_item(step: Path, marker: Path, target: str) -> None:
    """Metadata made only of allowed classes, declaring `target` as a bytes item whose bytes are
    a pickle that runs a command (torch's planner would unpickle it with weights_only off)."""
    meta = pickle.loads((step / ".metadata").read_bytes())
    payload = pickle.dumps(_Reduce(os.system, (_touch_cmd(marker),)))
    (step / "evil.distcp").write_bytes(payload)
    meta.state_dict_metadata[target] = BytesStorageMetadata()
    meta.storage_data[MetadataIndex(target)] = _StorageInfo("evil.distcp", 0, len(payload))
    (step / ".metadata").write_bytes(pickle.dumps(meta))


def test_trainer_resume_never_unpickles_bytes_items(trainer_step, marker):
    meta = pickle.loads((trainer_step / ".metadata").read_bytes())
    target = next(k for k in meta.state_dict_metadata if k.startswith("model."))
    _evil_bytes_item(trainer_step, marker, target)
    _resume_refused(trainer_step.parent)
    assert not marker.exists()


def test_plain_bytes_items_still_load(tmp_path):
    """Non-tensor values DCP stores as bytes still load (decoded weights-only)."""
    saved = {"step": 7, "name": "run-a", "w": torch.arange(4.0)}
    dcp.save(saved, checkpoint_id=tmp_path, no_dist=True)
    loaded = {"step": 0, "name": "", "w": torch.zeros(4)}
    dcp.load(loaded, storage_reader=SafeFileSystemReader(tmp_path), no_dist=True)
    assert loaded["step"] == 7 and loaded["name"] == "run-a"
    assert torch.equal(loaded["w"], saved["w"])


@pytest.mark.parametrize("where", ["../outside", "absolute", "symlink"])
def test_storage_files_outside_the_checkpoint_are_refused(trainer_step, tmp_path, where):
    """Metadata pointing an item's storage at another directory's file: the foreign weights
    (seed 2) must not reach the model being resumed (seed 0)."""
    foreign = tmp_path / "foreign"
    CheckpointManager(foreign).save(1, _fresh_state(seed=2))
    foreign_file = next((foreign / "step-000001").glob("*.distcp"))
    meta = pickle.loads((trainer_step / ".metadata").read_bytes())
    if where == "symlink":
        name = "link.distcp"
        (trainer_step / name).symlink_to(foreign_file)
    elif where == "absolute":
        name = str(foreign_file)
    else:
        name = f"../../foreign/step-000001/{foreign_file.name}"
    for info in meta.storage_data.values():
        info.relative_path = name
    (trainer_step / ".metadata").write_bytes(pickle.dumps(meta))
    state = _resume_refused(trainer_step.parent)
    assert all(torch.equal(v, _params(_fresh_state(0))[k]) for k, v in _params(state).items())


def test_declared_tensor_size_beyond_the_files_is_refused(trainer_step):
    meta = pickle.loads((trainer_step / ".metadata").read_bytes())
    item = next(v for k, v in meta.state_dict_metadata.items() if k.startswith("model."))
    item.size = torch.Size([2**40, 2**20])
    item.chunks[0].sizes = item.size
    (trainer_step / ".metadata").write_bytes(pickle.dumps(meta))
    with pytest.raises(ValueError, match="declares"):
        SafeFileSystemReader(trainer_step).read_metadata()
    _resume_refused(trainer_step.parent)


def test_allowed_helper_with_crafted_argument_runs_nothing(trainer_step, marker):
    """`_get_layout` is allowed (layouts pickle through it); a crafted name is a lookup miss."""
    blob = _stack_global("torch.serialization", "_get_layout", _touch_cmd(marker))
    (trainer_step / ".metadata").write_bytes(blob)
    _resume_refused(trainer_step.parent)
    assert not marker.exists()


# -- inference loader and converter over gRPC (native checkpoints) ---------------------------


@pytest.fixture(scope="module")
def native_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama converted HF -> native (a checkpoint the inference server can load)."""
    base = tmp_path_factory.mktemp("native")
    hf = save_hf(hf_llama_gqa(num_layers=2), base / "hf")
    convert(ConvertOptions("hf", "native", hf, base / "native"))
    return base / "native"


@pytest.fixture
def hostile_native(native_model: Path, tmp_path: Path) -> Path:
    root = tmp_path / "root"
    root.mkdir()
    shutil.copytree(native_model, root / "native")
    return root / "native"


def _native_step(native: Path) -> Path:
    return next(native.glob("step-*"))


@pytest.mark.parametrize(
    "payload", ["dcp.filesystem.os.system-STACK_GLOBAL", "os.system-protocol2", "builtins.exec"]
)
def test_inference_load_refuses_metadata_payload(hostile_native, marker, payload):
    (_native_step(hostile_native) / ".metadata").write_bytes(_payloads(marker)[payload])
    with pytest.raises(ValueError, match="DCP metadata"):
        read_state(hostile_native, "native", None)
    assert not marker.exists()


@pytest.mark.parametrize(
    "payload", ["dcp.filesystem.os.system-STACK_GLOBAL", "posix.system-GLOBAL"]
)
def test_convert_native_to_hf_over_grpc_refuses_metadata_payload(hostile_native, marker, payload):
    (_native_step(hostile_native) / ".metadata").write_bytes(_payloads(marker)[payload])
    root = hostile_native.parent
    request = converter_pb2.ConvertRequest(
        load_format=checkpoint_pb2.CHECKPOINT_FORMAT_NATIVE,
        save_format=checkpoint_pb2.CHECKPOINT_FORMAT_HF,
        load_dir=str(hostile_native),
        save_dir=str(root / "hf-out"),
    )
    code, _ = convert_over_grpc(root, request)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert not marker.exists() and not (root / "hf-out").exists()


def test_inference_load_allocates_nothing_for_an_oversized_shape(hostile_native, monkeypatch):
    """A shape in the metadata 2**34 elements large (with the files unchanged): refused before
    any tensor of that size is requested."""
    step = _native_step(hostile_native)
    meta = pickle.loads((step / ".metadata").read_bytes())
    item = meta.state_dict_metadata["model.embed_tokens.weight"]
    item.size = item.chunks[0].sizes = torch.Size([2**17, 2**17])
    (step / ".metadata").write_bytes(pickle.dumps(meta))
    requested: list[int] = []
    real_empty = torch.empty

    def spy(*size, **kwargs):
        shape = size[0] if len(size) == 1 and isinstance(size[0], tuple | list) else size
        requested.append(int(torch.Size(shape).numel()))
        return real_empty(*size, **kwargs)

    monkeypatch.setattr(torch, "empty", spy)
    with pytest.raises(ValueError, match="DCP metadata"):
        read_state(hostile_native, "native", None)
    assert max(requested, default=0) < 2**20


# -- torch.load files: Megatron legacy, DeepSpeed, FSDP full state dicts, LoRA .bin ----------


def _megatron_dir(root: Path, state: dict) -> Path:
    directory = root / "megatron"
    rank = directory / "iter_0000001" / "mp_rank_00"
    rank.mkdir(parents=True)
    torch.save(state, rank / megatron_format.FILE)
    (directory / megatron_format.TRACKER).write_text("1")
    return directory


@pytest.mark.parametrize("place", ["args", "model", "namespace-attribute"])
def test_megatron_file_with_code_is_refused_over_grpc(tmp_path, marker, place):
    evil = _Reduce(os.system, (_touch_cmd(marker),))
    state: dict = {"iteration": 1, "model": {"w": torch.ones(2)}, "args": argparse.Namespace()}
    if place == "args":
        state["args"] = evil
    elif place == "model":
        state["model"]["w"] = evil
    else:
        state["args"].tensor_model_parallel_size = evil
    directory = _megatron_dir(tmp_path, state)
    request = converter_pb2.ConvertRequest(
        load_format=checkpoint_pb2.CHECKPOINT_FORMAT_MEGATRON,
        save_format=checkpoint_pb2.CHECKPOINT_FORMAT_HF,
        load_dir=str(directory),
        save_dir=str(tmp_path / "out"),
        model="tiny-llama-gqa",
    )
    code, message = convert_over_grpc(tmp_path, request)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, message
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_megatron_args_with_absurd_parallel_size_are_refused(tmp_path):
    args = argparse.Namespace(tensor_model_parallel_size=10**12)
    directory = _megatron_dir(tmp_path, {"iteration": 1, "model": {}, "args": args})
    with pytest.raises(ValueError, match="tensor_model_parallel_size"):
        megatron_format.MegatronSource(directory, get_config("tiny-llama-gqa"))


def test_deepspeed_files_with_code_are_refused(tmp_path, marker):
    tag = tmp_path / "ds" / "global_step1"
    tag.mkdir(parents=True)
    (tmp_path / "ds" / deepspeed_format.TAG_FILE).write_text("global_step1")
    evil = {"optimizer_state_dict": _Reduce(os.system, (_touch_cmd(marker),))}
    torch.save(evil, tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    torch.save(evil, tag / "mp_rank_00_model_states.pt")
    with pytest.raises(ValueError, match="refused"):
        deepspeed_format.DeepSpeedSource(tmp_path / "ds", get_config("tiny-llama-gqa"))
    with pytest.raises(ValueError, match="refused"):
        deepspeed_format.load_file(tag / "mp_rank_00_model_states.pt")
    assert not marker.exists()


def test_fsdp_full_state_dict_with_code_is_refused(tmp_path, marker):
    (tmp_path / "fsdp").mkdir()
    # Padded past the declared model size, so the file is actually opened (and refused).
    evil = {"w": _Reduce(os.system, (_touch_cmd(marker),)), "pad": torch.zeros(2**18)}
    torch.save(evil, tmp_path / "fsdp" / "model.bin")
    with pytest.raises(ValueError, match="weights-only"):
        FSDPSource(tmp_path / "fsdp", get_config("tiny-llama-gqa"))
    assert not marker.exists()


def test_lora_bin_with_code_is_refused(tmp_path, marker):
    adapter = tmp_path / "lora"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"r": 2, "lora_alpha": 4}))
    torch.save({"x": _Reduce(os.system, (_touch_cmd(marker),))}, adapter / "adapter_model.bin")
    with pytest.raises(ValueError, match="refused"):
        LoraAdapter(adapter)
    assert not marker.exists()


class _Witness:
    """An allow-listed type that records every time the unpickler builds one."""

    built: ClassVar[list[int]] = []

    def __setstate__(self, state: dict) -> None:
        _Witness.built.append(1)
        self.__dict__.update(state)


def test_torch_file_is_refused_before_any_object_is_built(tmp_path, marker):
    """An allowed object first, a hostile global after it: the static check refuses the file
    before the allowed object is built (plain weights-only loading would build it first)."""
    path = tmp_path / "model_optim_rng.pt"
    witness = _Witness()
    witness.value = 1
    torch.save({"first": witness, "then": _Reduce(os.system, (_touch_cmd(marker),))}, path)
    _Witness.built.clear()
    with pytest.raises(RefusedGlobals, match=r"posix\.system"):
        load_weights_only(path, [_Witness], "test")
    assert _Witness.built == [] and not marker.exists()
    torch.save({"first": witness}, path)
    assert load_weights_only(path, [_Witness], "test")["first"].value == 1
    assert _Witness.built == [1]
