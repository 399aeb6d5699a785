"""Destructive and oversized conversion requests: the data root, the source, an ancestor or
descendant of it, somebody else's directory or a symlink as `save_dir` (with overwrite=true), and
config/header sizes far beyond the files. Every test asserts containment by its side effect:
a sentinel in the data root and the source's bytes survive, nothing is written, and oversized
inputs are refused by a child process whose address space is capped (so an allocation of the
declared size would fail with MemoryError instead of the expected refusal).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import grpc
import pytest

from checkpoints.safetensors_stream import read_header
from meshline.common.v1 import checkpoint_pb2
from meshline.converter.v1 import converter_pb2
from services.common.operations import OperationsStore
from services.converter import cli, output_dir
from services.converter.config import ConverterServiceConfig
from services.converter.output_dir import MARKER, publish, staging_dir, write_marker
from services.converter.servicer import bindings as converter_bindings
from tests.security.grpc_convert import convert_over_grpc
from tests.services.converter.conftest import hf_llama_gqa, save_hf

HF, NATIVE = checkpoint_pb2.CHECKPOINT_FORMAT_HF, checkpoint_pb2.CHECKPOINT_FORMAT_NATIVE
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_hf(hf_llama_gqa(num_layers=2), tmp_path_factory.mktemp("tiny") / "hf")


def _digest(directory: Path) -> dict[str, str]:
    """Every file under `directory` with its SHA-256 (what must survive unchanged)."""
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


@pytest.fixture
def root(tmp_path: Path, tiny_hf: Path) -> Path:
    """A data root: the source at models/hf, a sentinel, an unrelated user directory."""
    data = tmp_path / "data"
    shutil.copytree(tiny_hf, data / "models" / "hf")
    (data / "sentinel.txt").write_text("must survive")
    (data / "other").mkdir()
    (data / "other" / "notes.txt").write_text("somebody else's work")
    return data


def _request(root: Path, save_dir: str, **extra) -> converter_pb2.ConvertRequest:
    return converter_pb2.ConvertRequest(
        load_format=HF,
        save_format=NATIVE,
        load_dir=str(root / "models" / "hf"),
        save_dir=save_dir,
        **{"overwrite": True, **extra},
    )


def _no_staging_left(directory: Path) -> bool:
    return not [
        p for p in directory.rglob(".*") if ".converting-" in p.name or ".replaced-" in p.name
    ]


@pytest.mark.parametrize(
    ("target", "code"),
    [
        ("", grpc.StatusCode.INVALID_ARGUMENT),  # the data root itself
        ("models", grpc.StatusCode.INVALID_ARGUMENT),  # an ancestor of the source
        ("models/hf", grpc.StatusCode.INVALID_ARGUMENT),  # the source
        ("models/hf/out", grpc.StatusCode.INVALID_ARGUMENT),  # inside the source
        ("other", grpc.StatusCode.FAILED_PRECONDITION),  # a directory the converter did not write
        ("sentinel.txt", grpc.StatusCode.FAILED_PRECONDITION),  # an existing file
    ],
)
def test_destructive_save_dir_is_refused(root, target, code):
    before = _digest(root)
    status, message = convert_over_grpc(root, _request(root, str(root / target)))
    assert status == code, message
    assert _digest(root) == before
    assert _no_staging_left(root.parent)


def test_symlink_save_dir_leaving_the_root_is_refused(root, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("outside the root")
    (root / "link").symlink_to(outside)
    before, outside_before = _digest(root), _digest(outside)
    status, message = convert_over_grpc(root, _request(root, str(root / "link")))
    assert status == grpc.StatusCode.PERMISSION_DENIED, message
    assert _digest(root) == before and _digest(outside) == outside_before


def test_symlink_save_dir_to_an_ancestor_of_the_source_is_refused(root):
    (root / "alias").symlink_to(root / "models")
    before = _digest(root)
    status, message = convert_over_grpc(root, _request(root, str(root / "alias")))
    assert status == grpc.StatusCode.INVALID_ARGUMENT, message
    assert _digest(root) == before


def test_save_dir_above_the_lora_adapter_is_refused(root):
    adapter = root / "adapters" / "lora"
    adapter.mkdir(parents=True)
    (adapter / "adapter_config.json").write_text(json.dumps({"r": 2, "lora_alpha": 4}))
    before = _digest(root)
    request = _request(root, str(root / "adapters"), merge_lora=True, lora_load_dir=str(adapter))
    status, message = convert_over_grpc(root, request)
    assert status == grpc.StatusCode.INVALID_ARGUMENT, message
    assert _digest(root) == before


def test_forged_marker_symlink_does_not_allow_overwrite(root, tmp_path):
    """A converter manifest linked (not written) into a user directory does not make it ours."""
    real = tmp_path / "real-output"
    real.mkdir()
    write_marker(real, {"format": "native"})
    (root / "other" / MARKER).symlink_to(real / MARKER)
    before = _digest(root)
    status, message = convert_over_grpc(root, _request(root, str(root / "other")))
    assert status == grpc.StatusCode.FAILED_PRECONDITION, message
    assert _digest(root) == before


def test_overwrite_replaces_only_the_converters_own_output(root):
    first, _ = convert_over_grpc(root, _request(root, str(root / "out"), overwrite=False))
    assert first == grpc.StatusCode.OK
    (root / "out" / "stale.txt").write_text("from the previous conversion's directory")
    sentinel = (root / "sentinel.txt").read_text()
    source = _digest(root / "models" / "hf")
    again, message = convert_over_grpc(root, _request(root, str(root / "out")))
    assert again == grpc.StatusCode.OK, message
    assert not (root / "out" / "stale.txt").exists() and (root / "out" / MARKER).is_file()
    assert (root / "out" / "latest").is_file()
    assert (root / "sentinel.txt").read_text() == sentinel
    assert _digest(root / "models" / "hf") == source
    assert _no_staging_left(root)
    # The output records the source state it came from (#37: converter provenance).
    marker = json.loads((root / "out" / MARKER).read_text())
    hf = root / "models" / "hf"
    assert marker["source"]["load_dir"] == output_dir.source_fingerprint(hf, "--load-dir")
    config = hf / "config.json"
    config.write_text(config.read_text() + " ")
    changed = output_dir.source_fingerprint(hf, "--load-dir")
    assert changed["sha256"] != marker["source"]["load_dir"]["sha256"]


def test_cli_refuses_an_ancestor_of_the_source(root, capsys):
    before = _digest(root)
    argv = ["--load-format", "hf", "--save-format", "native"]
    argv += ["--load-dir", str(root / "models" / "hf"), "--save-dir", str(root), "--overwrite"]
    assert cli.main(argv) == cli.EXIT_FAILED
    assert _digest(root) == before
    assert str(root) in capsys.readouterr().err


def test_publish_refuses_a_save_dir_swapped_for_a_symlink(tmp_path):
    """save_dir replaced by a symlink while the conversion ran: the link target is untouched."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "data.txt").write_text("precious")
    write_marker(victim, {"format": "native"})
    save = tmp_path / "out"
    tmp = staging_dir(save)
    (tmp.path / "new.txt").write_text("new output")
    save.symlink_to(victim)
    with pytest.raises(FileExistsError, match="symlink"):
        publish(tmp, save, overwrite=True)
    assert (victim / "data.txt").read_text() == "precious" and save.is_symlink()


# -- sizes declared by files ------------------------------------------------------------------

_LIMITED_LOAD = textwrap.dedent(
    """
    import json, resource, sys
    from pathlib import Path
    from checkpoints.hf_format import HFSource
    vm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmSize:"))
    cap = vm * 1024 + 1024**3  # what is mapped now, plus 1 GiB
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    try:
        HFSource(Path(sys.argv[1]))
        print(json.dumps({"error": None}))
    except BaseException as exc:
        print(json.dumps({"error": type(exc).__name__, "message": str(exc)}))
    """
)


def _load_with_capped_memory(directory: Path) -> dict:
    """HFSource(directory) in a child whose address space is capped at +1 GiB."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", _LIMITED_LOAD, str(directory)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _with_config(root: Path, **fields) -> Path:
    source = root / "models" / "hf"
    config = json.loads((source / "config.json").read_text())
    config.update(fields)
    (source / "config.json").write_text(json.dumps(config))
    return source


@pytest.mark.parametrize(
    ("hf_field", "value", "named"),
    [
        ("num_hidden_layers", 10**9, "num_layers"),
        ("num_hidden_layers", 1e9, "num_layers"),
        ("hidden_size", 2**31, "hidden_size"),
        ("num_attention_heads", 10**9, "num_attention_heads"),
        ("vocab_size", 10**12, "vocab_size"),
        ("intermediate_size", 10**10, "ffn_hidden_size"),
        # Within the sanity bounds, but far more parameters than the files hold.
        ("num_hidden_layers", 2000, "num_layers"),
    ],
)
def test_oversized_config_is_refused_before_allocation(root, hf_field, value, named):
    source = _with_config(root, **{hf_field: value})
    outcome = _load_with_capped_memory(source)
    assert outcome["error"] == "ValueError", outcome  # not MemoryError, not success
    assert named in outcome["message"]


def test_oversized_config_over_grpc_writes_nothing(root):
    _with_config(root, num_hidden_layers=10**9)
    before = _digest(root)
    status, message = convert_over_grpc(root, _request(root, str(root / "out")))
    assert status == grpc.StatusCode.INVALID_ARGUMENT and "num_layers" in message
    assert _digest(root) == before and not (root / "out").exists()


@pytest.mark.parametrize(
    ("shape", "end"),
    [([2**20, 2**20], 4 * 2**40), ([-1, -4], 16), ([2**62, 4], 0)],
    ids=["huge", "negative", "overflowing"],
)
def test_safetensors_header_with_a_hostile_shape_is_refused(root, shape, end):
    source = root / "models" / "hf"
    header = {"model.embed_tokens.weight": {"dtype": "F32", "shape": shape}}
    header["model.embed_tokens.weight"]["data_offsets"] = [0, end]
    raw = json.dumps(header).encode()
    (source / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 64)
    outcome = _load_with_capped_memory(source)
    assert outcome["error"] == "ValueError", outcome
    assert "model.embed_tokens.weight" in outcome["message"]


def test_index_naming_a_file_outside_the_checkpoint_is_refused(root, tmp_path):
    """A sharded index pointing at another checkpoint's weights: they must not be converted."""
    foreign = save_hf(hf_llama_gqa(num_layers=2), tmp_path / "foreign")
    source = root / "models" / "hf"
    keys = read_header(foreign / "model.safetensors")[0]
    outside = os.path.relpath(foreign / "model.safetensors", source)
    index = {"weight_map": dict.fromkeys(keys, outside)}
    (source / "model.safetensors.index.json").write_text(json.dumps(index))
    status, message = convert_over_grpc(root, _request(root, str(root / "out")))
    assert status == grpc.StatusCode.INVALID_ARGUMENT, message
    assert not (root / "out").exists()


def _old_and_new(tmp_path: Path) -> tuple[output_dir.Staging, Path]:
    save = tmp_path / "out"
    save.mkdir()
    write_marker(save, {"format": "native"})
    (save / "old.txt").write_text("old output")
    tmp = staging_dir(save)
    write_marker(tmp.path, {"format": "native"})
    (tmp.path / "new.txt").write_text("new output")
    return tmp, save


def test_publish_swaps_in_one_step_where_the_kernel_can(tmp_path, monkeypatch):
    """With renameat2 the old output is never moved aside first: no plain rename happens."""
    tmp, save = _old_and_new(tmp_path)

    def no_rename(*args):
        raise AssertionError(f"two-step rename used: {args}")

    monkeypatch.setattr(output_dir.os, "rename", no_rename)
    publish(tmp, save, overwrite=True)
    assert (save / "new.txt").is_file() and not (save / "old.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_publish_without_renameat2_still_replaces_completely(tmp_path, monkeypatch):
    tmp, save = _old_and_new(tmp_path)
    monkeypatch.setattr(output_dir, "_exchange", lambda parent, a, b: False)
    publish(tmp, save, overwrite=True)
    assert (save / "new.txt").is_file() and not (save / "old.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_publish_and_cleanup_follow_no_parent_swapped_during_the_conversion(tmp_path):
    """The folder holding save_dir swapped for a symlink mid-run: nothing lands or is deleted
    outside; the output is published where the conversion started (#37 finding 4)."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "sentinel").write_text("not yours")
    parent = tmp_path / "models"
    staged = staging_dir(parent / "out")
    write_marker(staged.path, {"format": "native"})
    parent.rename(tmp_path / "models.moved")
    parent.symlink_to(outside, target_is_directory=True)
    publish(staged, parent / "out", overwrite=False)
    assert sorted(p.name for p in outside.iterdir()) == ["sentinel"]
    assert (tmp_path / "models.moved" / "out" / output_dir.MARKER).is_file()
    assert not (tmp_path / "models.moved" / "out" / ".owner").exists()
    failed = staging_dir(tmp_path / "models.moved" / "again")
    (outside / failed.name).mkdir()  # a same-named folder outside that clean-up must not touch
    (tmp_path / "models.moved").rename(tmp_path / "models.again")
    (tmp_path / "models.moved").symlink_to(outside, target_is_directory=True)
    output_dir.discard(failed)
    assert (outside / failed.name).is_dir()
    assert not (tmp_path / "models.again" / failed.name).exists()


def test_a_killed_conversions_staging_is_removed_at_service_start(root, tmp_path):
    """kill -9 mid-conversion leaves a full-size staging folder: the next start removes it, and
    only the converter's own staging names (a preprocess one, a user's folder stay)."""
    script = (
        "import os, sys, time; from pathlib import Path; "
        "from services.converter.output_dir import staging_dir; "
        "s = staging_dir(Path(sys.argv[1])); (s.path / 'model.bin').write_bytes(bytes(1 << 20)); "
        "print(s.name, flush=True); time.sleep(60)"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", script, str(root / "out")], stdout=subprocess.PIPE, text=True
    )
    name = child.stdout.readline().strip()
    child.kill()
    child.wait()
    child.stdout.close()
    assert (root / name / "model.bin").stat().st_size == 1 << 20
    keep = [root / ".out.partial-abcd1234", root / ".notes.converting-keep"]
    for folder in keep:
        folder.mkdir()
    converter_bindings(ConverterServiceConfig(data_roots=(root,)), OperationsStore(None))
    assert not (root / name).exists()
    assert all(folder.is_dir() for folder in keep)
