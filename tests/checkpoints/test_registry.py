"""One source of truth for checkpoint formats: checkpoints/registry.py.

The proto enum `meshline.common.v1.CheckpointFormat`, the fields that carry it in the converter,
evaluator and inference contracts, the `--load-format` / `--save-format` choices of `meshline
convert`, `meshline generate`, `meshline serve inference` and `meshline evaluate`, the servicers'
enum maps and the ModelLink loader/saver aliases must all name the registry's formats; a registry
entry without an enum value (or the reverse) fails here.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

import checkpoints.registry as registry
from checkpoints.registry import (
    FORMATS,
    READ_FORMATS,
    SERVE_CHOICES,
    SERVE_FORMATS,
    WRITE_FORMATS,
    detect_format,
    get_format,
)
from meshline.common.v1 import checkpoint_pb2
from meshline.converter.v1 import converter_pb2
from meshline.evaluator.v1 import evaluator_pb2
from meshline.inference.v1 import inference_pb2
from services.common.checkpoint_formats import KEYS, PREFIX, VALUES
from services.common.errors import InvalidArgument

ROOT = Path(__file__).resolve().parents[2]
Enum = checkpoint_pb2.CheckpointFormat


def disagreements(formats: dict[str, registry.FormatSpec]) -> list[str]:
    """What differs between `formats` and the proto enum (empty when they agree)."""
    enum_keys = {
        name.removeprefix(PREFIX).lower()
        for name, number in Enum.items()
        if number != checkpoint_pb2.CHECKPOINT_FORMAT_UNSPECIFIED
    }
    problems = [f"registry format {key!r} has no enum value" for key in formats.keys() - enum_keys]
    problems += [
        f"enum value of {key!r} has no registry entry" for key in enum_keys - formats.keys()
    ]
    return problems


def test_registry_and_enum_name_the_same_formats():
    assert disagreements(FORMATS) == []
    assert set(KEYS.values()) == set(FORMATS) and {VALUES[k] for k in FORMATS} == set(KEYS)


def test_a_registry_entry_without_an_enum_value_is_caught():
    extra = replace(FORMATS["hf"], key="onnx", label="ONNX")
    assert disagreements({**FORMATS, "onnx": extra}) == ["registry format 'onnx' has no enum value"]
    fewer = {key: spec for key, spec in FORMATS.items() if key != "fsdp"}
    assert disagreements(fewer) == ["enum value of 'fsdp' has no registry entry"]


def test_enum_numbers_keep_the_converter_and_evaluator_wire_format():
    # converter.v1.CheckpointFormat had these numbers; evaluator.v1.LoadFormat had 1-3.
    assert dict(Enum.items()) == {
        "CHECKPOINT_FORMAT_UNSPECIFIED": 0,
        "CHECKPOINT_FORMAT_HF": 1,
        "CHECKPOINT_FORMAT_NATIVE": 2,
        "CHECKPOINT_FORMAT_MEGATRON": 3,
        "CHECKPOINT_FORMAT_DEEPSPEED": 4,
        "CHECKPOINT_FORMAT_FSDP": 5,
        "CHECKPOINT_FORMAT_GGUF": 6,
        "CHECKPOINT_FORMAT_QUANTIZED": 7,
    }
    assert list(FORMATS) == [KEYS[n] for n in sorted(KEYS)], "registry order is enum order"


def test_every_contract_carries_the_common_enum():
    common = Enum.DESCRIPTOR.full_name
    assert common == "meshline.common.v1.CheckpointFormat"
    fields = [
        converter_pb2.ConvertRequest.DESCRIPTOR.fields_by_name["load_format"],
        converter_pb2.ConvertRequest.DESCRIPTOR.fields_by_name["save_format"],
        evaluator_pb2.LocalModel.DESCRIPTOR.fields_by_name["load_format"],
        inference_pb2.GetModelInfoResponse.DESCRIPTOR.fields_by_name["checkpoint_format"],
    ]
    for field in fields:
        assert field.enum_type is not None and field.enum_type.full_name == common, field.full_name
    for module in (converter_pb2, evaluator_pb2, inference_pb2):
        assert not [e for e in module.DESCRIPTOR.enum_types_by_name if "Format" in e]
    old = inference_pb2.GetModelInfoResponse.DESCRIPTOR.fields_by_name["load_format"]
    assert old.number == 11 and old.type == old.TYPE_STRING and old.GetOptions().deprecated


def _choices(parser, flag: str) -> tuple[str, ...]:
    (action,) = [a for a in parser._actions if flag in a.option_strings]
    return tuple(action.choices)


def test_cli_choices_come_from_the_registry():
    import argparse

    from services.converter.cli import build_parser as convert_parser
    from services.evaluator.cli import build_parser as evaluate_parser
    from services.inference.cli import build_parser as generate_parser
    from services.inference.config import add_flags as serve_flags

    assert _choices(convert_parser(), "--load-format") == READ_FORMATS == tuple(FORMATS)
    assert (
        _choices(convert_parser(), "--save-format")
        == WRITE_FORMATS
        == ("hf", "native", "megatron", "gguf", "quantized")
    )
    assert SERVE_FORMATS == ("hf", "native", "megatron", "quantized")
    assert SERVE_CHOICES[0] == "auto"
    serve = argparse.ArgumentParser()
    serve_flags(serve)
    for parser in (generate_parser(), evaluate_parser(), serve):
        assert _choices(parser, "--load-format") == SERVE_CHOICES


def test_modellink_loader_and_saver_aliases_name_registry_formats():
    from services.converter.modellink_flags import LOADERS, SAVERS

    assert set(LOADERS.values()) <= set(READ_FORMATS)
    assert set(SAVERS.values()) <= set(WRITE_FORMATS)


def test_converter_servicer_maps_follow_the_registry(tmp_path):
    from services.converter.config import ConverterServiceConfig
    from services.converter.servicer import FORMAT_KEYS, WRITTEN_KEYS, check_fields

    assert {VALUES[key]: key for key in READ_FORMATS} == FORMAT_KEYS
    assert {VALUES[key]: key for key in WRITE_FORMATS} == WRITTEN_KEYS
    config = ConverterServiceConfig(data_roots=(tmp_path,))
    hf = checkpoint_pb2.CHECKPOINT_FORMAT_HF
    for number in [*Enum.values(), 8, -1]:
        request = converter_pb2.ConvertRequest(
            load_format=number, save_format=hf, load_dir="a", save_dir="b", dtype=1
        )
        read = number in VALUES.values()
        if read:
            check_fields(request, config)
        else:
            with pytest.raises(InvalidArgument, match="load_format"):
                check_fields(request, config)
        request = converter_pb2.ConvertRequest(
            load_format=hf, save_format=number, load_dir="a", save_dir="b", dtype=1
        )
        # a quantized output needs a scheme, which ConvertRequest does not carry
        if read and FORMATS[KEYS[number]].writes and KEYS[number] != "quantized":
            check_fields(request, config)
        else:
            with pytest.raises(InvalidArgument, match="save_format"):
                check_fields(request, config)


def test_evaluator_accepts_exactly_the_served_formats(tmp_path):
    from services.evaluator.config import EvaluatorServiceConfig
    from services.evaluator.servicer import check_fields

    config = EvaluatorServiceConfig(data_roots=(tmp_path,))
    for number in [*Enum.values(), 8, -1]:
        request = evaluator_pb2.StartEvaluationRequest(
            tasks=["boolq"],
            task_data_path="data",
            local=evaluator_pb2.LocalModel(load_dir="ckpt", load_format=number),
        )
        if KEYS.get(number) in SERVE_FORMATS:
            check_fields(request, config)
        else:
            with pytest.raises(InvalidArgument, match=r"local\.load_format") as caught:
                check_fields(request, config)
            assert "HF, NATIVE, MEGATRON or QUANTIZED" in str(caught.value)


def test_get_format_names_the_flag_and_the_choices():
    assert get_format("megatron").model_parallel and get_format("deepspeed").iterations
    with pytest.raises(ValueError, match=r"--save-format 'fsdp': expected one of \['hf'"):
        get_format("fsdp", "--save-format", WRITE_FORMATS)
    with pytest.raises(ValueError, match="--load-format 'onnx'"):
        get_format("onnx")


def _touch(directory: Path, *names: str) -> Path:
    directory.mkdir()
    for name in names:
        (directory / name).write_text("1\n")
    return directory


def test_detection_follows_the_registry_in_rank_order(tmp_path):
    from checkpoints.megatron_format import TRACKER

    assert registry.MEGATRON_TRACKER == TRACKER
    assert detect_format(_touch(tmp_path / "hf", "config.json", "model.safetensors")) == "hf"
    assert detect_format(_touch(tmp_path / "native", "latest")) == "native"
    assert detect_format(_touch(tmp_path / "dcp", ".metadata")) == "native"
    assert detect_format(_touch(tmp_path / "mg", TRACKER)) == "megatron"
    assert detect_format(_touch(tmp_path / "q", "quantization.json", "config.json")) == (
        "quantized"
    )
    # a directory some tool filled with several formats' files: the lowest rank wins
    mixed = _touch(tmp_path / "mixed", TRACKER, "latest", "config.json", "model.safetensors")
    assert detect_format(mixed) == "megatron"
    assert detect_format(_touch(tmp_path / "both", "latest", "config.json", "a.safetensors")) == (
        "native"
    )
    with pytest.raises(ValueError, match="pass --load-format") as caught:
        detect_format(_touch(tmp_path / "empty", "config.json"))
    for key in SERVE_FORMATS:
        assert FORMATS[key].layout in str(caught.value)


def test_read_only_formats_have_no_writer_and_are_refused_as_output(tmp_path):
    from services.converter.options import ConvertOptions

    for key in set(READ_FORMATS) - set(WRITE_FORMATS):
        assert FORMATS[key].open_sink is None
        with pytest.raises(ValueError, match=f"--save-format '{key}'"):
            ConvertOptions(key, key, tmp_path / "a", tmp_path / "b")
    with pytest.raises(ValueError, match="only megatron outputs are saved per tensor/pipeline"):
        ConvertOptions("hf", "native", tmp_path / "a", tmp_path / "b", target_tp=2)


def test_the_cli_modules_build_their_choices_without_torch():
    code = (
        "import sys\n"
        "import checkpoints.registry, services.inference.cli, services.evaluator.cli\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
