"""Bad inputs fail with errors that name the input and the fix, and leave no output behind; the
parity gate fails a conversion that changed the model; `meshline convert` exit codes."""

from __future__ import annotations

import shutil

import pytest
import torch

from checkpoints import megatron_layout
from checkpoints.megatron_format import load_file
from services.converter import cli
from services.converter.job import ConvertOptions, VerificationFailed, convert


class NotAllowListed:
    """Any class outside the allow-list (a crafted file could name one with a harmful reduce)."""


def _save_over(state: dict, path) -> None:
    """Replace `path` with `state`, keeping the mapped original readable until it is dropped."""
    partial = path.with_name(path.name + ".edit")
    torch.save(state, partial)
    partial.replace(path)


def _nothing_written(parent, name="out"):
    # Neither the output nor a hidden temporary sibling survives a failure.
    return not (parent / name).exists() and not list(parent.glob(f".{name}*"))


def test_truncated_safetensors(llama_dir, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(llama_dir, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"model\.safetensors"):
        convert(ConvertOptions("hf", "megatron", broken, tmp_path / "out"))
    assert _nothing_written(tmp_path)


def test_garbage_safetensors_header(llama_dir, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(llama_dir, broken)
    (broken / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(ValueError, match="not a readable safetensors"):
        convert(ConvertOptions("hf", "native", broken, tmp_path / "out"))
    assert _nothing_written(tmp_path)


def test_truncated_megatron_file(llama_dir, tmp_path):
    mg = tmp_path / "mg"
    convert(ConvertOptions("hf", "megatron", llama_dir, mg, target_pp=2))
    victim = mg / "release" / "mp_rank_00_001" / "model_optim_rng.pt"
    victim.write_bytes(victim.read_bytes()[:1000])
    with pytest.raises(ValueError, match=r"mp_rank_00_001.*truncated"):
        convert(ConvertOptions("megatron", "hf", mg, tmp_path / "out"))
    assert _nothing_written(tmp_path)


def test_missing_megatron_rank(llama_dir, tmp_path):
    mg = tmp_path / "mg"
    convert(ConvertOptions("hf", "megatron", llama_dir, mg, target_tp=2))
    shutil.rmtree(mg / "release" / "mp_rank_01")
    with pytest.raises(FileNotFoundError, match="TP rank 1"):
        convert(ConvertOptions("megatron", "hf", mg, tmp_path / "out"))


def test_megatron_file_with_objects_outside_the_allow_list(llama_dir, tmp_path):
    mg = tmp_path / "mg"
    convert(ConvertOptions("hf", "megatron", llama_dir, mg))
    path = mg / "release" / "mp_rank_00" / "model_optim_rng.pt"
    state = load_file(path)  # memory-mapped: save the edit under a new inode (_save_over)
    state["rng_state"] = NotAllowListed()
    _save_over(state, path)
    with pytest.raises(ValueError, match=r"refused to load; it holds .*NotAllowListed"):
        convert(ConvertOptions("megatron", "hf", mg, tmp_path / "out"))
    assert _nothing_written(tmp_path)


def test_mismatched_model_is_named(llama_dir, tmp_path):
    with pytest.raises(ValueError, match=r"--model does not match.*num_layers: checkpoint 4"):
        convert(ConvertOptions("hf", "native", llama_dir, tmp_path / "out", model="tiny-llama"))
    assert _nothing_written(tmp_path)


def test_mismatched_moe_settings_are_named():
    import dataclasses

    from checkpoints.units import reconcile
    from models.registry import get_config

    own = get_config("tiny-mixtral")
    assert reconcile(own, dataclasses.replace(own), "ckpt") is own
    # Loss weights and the capacity factor are training settings a run may change.
    lossy = dataclasses.replace(own.moe, aux_loss_coeff=0.01, capacity_factor=1.25)
    assert reconcile(own, dataclasses.replace(own, moe=lossy), "ckpt") is own
    more = dataclasses.replace(own, moe=dataclasses.replace(own.moe, num_experts=8, top_k=1))
    with pytest.raises(ValueError, match=r"moe.num_experts: checkpoint 4 vs --model 8; moe.top_k"):
        reconcile(own, more, "ckpt")
    with pytest.raises(
        ValueError, match=r"moe: checkpoint MoE \(4 experts, top-2\) vs --model dense"
    ):
        reconcile(own, dataclasses.replace(own, moe=None), "ckpt")


def test_megatron_without_config_needs_model_and_checks_it(llama_dir, tmp_path):
    mg = tmp_path / "mg"
    convert(ConvertOptions("hf", "megatron", llama_dir, mg))
    path = mg / "release" / "mp_rank_00" / "model_optim_rng.pt"
    state = load_file(path)  # memory-mapped: save the edit under a new inode (_save_over)
    del state["args"].meshline_model_config  # as a checkpoint written by Megatron itself
    _save_over(state, path)
    with pytest.raises(ValueError, match="pass --model NAME"):
        convert(ConvertOptions("megatron", "hf", mg, tmp_path / "out"))
    with pytest.raises(ValueError, match="num_layers=4 but the model config has num_layers=2"):
        convert(ConvertOptions("megatron", "hf", mg, tmp_path / "out", model="tiny-llama-gqa"))
    # The right architecture by name (a registry config with the checkpoint's sizes) works.
    from models.registry import get_config

    assert get_config("tiny-llama-gqa").num_layers == 2
    assert _nothing_written(tmp_path)


def test_existing_output_needs_overwrite(llama_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    with pytest.raises(FileExistsError, match="--overwrite"):
        convert(ConvertOptions("hf", "native", llama_dir, out))
    assert (out / "keep.txt").read_text() == "precious"
    # --overwrite replaces only the converter's own outputs: a directory it did not write stays.
    with pytest.raises(FileExistsError, match="not written by the converter"):
        convert(ConvertOptions("hf", "native", llama_dir, out, overwrite=True))
    assert (out / "keep.txt").read_text() == "precious"
    (out / "keep.txt").unlink()
    convert(ConvertOptions("hf", "native", llama_dir, out))
    (out / "stale.txt").write_text("left by the earlier conversion's user")
    convert(ConvertOptions("hf", "native", llama_dir, out, overwrite=True))
    assert not (out / "stale.txt").exists() and (out / "latest").is_file()


def _corrupt_qkv(monkeypatch):
    """A deliberately wrong converter: Megatron's QKV interleave written in plain [q; k; v]."""
    monkeypatch.setattr(
        megatron_layout, "_interleave_qkv", lambda q, k, v, groups: torch.cat([q, k, v])
    )


def test_verify_fails_a_corrupted_conversion(llama_dir, tmp_path, monkeypatch):
    good = convert(ConvertOptions("hf", "megatron", llama_dir, tmp_path / "good", verify=True))
    assert good.verify is not None and good.verify.passed
    assert good.verify.max_abs_logit_diff == 0.0
    _corrupt_qkv(monkeypatch)
    with pytest.raises(VerificationFailed) as caught:
        convert(ConvertOptions("hf", "megatron", llama_dir, tmp_path / "out", verify=True))
    assert caught.value.report.max_abs_logit_diff > 1e-2
    assert _nothing_written(tmp_path)


def test_verify_tolerance_for_bf16(llama_dir, tmp_path):
    report = convert(
        ConvertOptions("hf", "hf", llama_dir, tmp_path / "bf16", dtype="bf16", verify=True)
    )
    assert report.verify is not None and report.verify.tolerance == 2e-2
    assert 0 < report.verify.max_abs_logit_diff <= 2e-2
    with pytest.raises(VerificationFailed):
        convert(
            ConvertOptions(
                "hf",
                "hf",
                llama_dir,
                tmp_path / "out",
                dtype="bf16",
                verify=True,
                verify_tolerance=1e-7,
            )
        )
    assert _nothing_written(tmp_path)


def test_cli_exit_codes(llama_dir, tmp_path, monkeypatch, capsys):
    base = ["--load-format", "hf", "--input-model-dir", str(llama_dir)]
    ok = [*base, "--save-format", "megatron", "--output-model-dir", str(tmp_path / "mg")]
    assert cli.main([*ok, "--tensor-model-parallel-size", "2", "--verify"]) == 0
    assert "verify: max |logit difference| 0" in capsys.readouterr().out
    assert cli.main([*ok]) == cli.EXIT_FAILED  # exists, no --overwrite
    assert "--overwrite" in capsys.readouterr().err
    assert (
        cli.main([*base, "--save-format", "hf", "--save-dir", str(tmp_path / "x"), "--merge-lora"])
        == 2
    )
    assert "--lora-load" in capsys.readouterr().err
    bad_tp = [
        *base,
        "--save-format",
        "hf",
        "--save-dir",
        str(tmp_path / "x"),
        "--target-tensor-parallel-size",
        "2",
    ]
    assert cli.main(bad_tp) == 2
    _corrupt_qkv(monkeypatch)
    out = [*base, "--save-format", "megatron", "--save-dir", str(tmp_path / "bad"), "--verify"]
    assert cli.main(out) == cli.EXIT_VERIFY
    assert "parity check failed" in capsys.readouterr().err
    assert _nothing_written(tmp_path, "bad")


def test_cli_help_explains_every_flag(capsys):
    with pytest.raises(SystemExit) as caught:
        cli.main(["--help"])
    assert caught.value.code == 0
    text = capsys.readouterr().out
    for flag in (
        "--load-format",
        "--save-format",
        "--load-dir",
        "--input-model-dir",
        "--save-dir",
        "--output-model-dir",
        "--model",
        "--type",
        "--target-tensor-parallel-size",
        "--tensor-model-parallel-size",
        "--target-pipeline-parallel-size",
        "--pipeline-model-parallel-size",
        "--num-layers-per-virtual-pipeline-stage",
        "--lora-load",
        "--merge-lora",
        "--dtype",
        "--verify",
        "--verify-tolerance",
    ):
        assert flag in text, flag
    parser = cli.build_parser()
    undocumented = [a.dest for a in parser._actions if not a.help]
    assert undocumented == []


def test_type_alias_names_a_llama2_config():
    args = cli.build_parser().parse_args(
        [
            "--load-format",
            "megatron",
            "--save-format",
            "hf",
            "--load-dir",
            "a",
            "--save-dir",
            "b",
            "--type",
            "7B",
        ]
    )
    assert cli.options_from_args(args).model == "llama2-7B"


def test_progress_reports_each_stage_in_order(llama_dir, tmp_path):
    seen = []
    convert(
        ConvertOptions("hf", "megatron", llama_dir, tmp_path / "out", verify=True),
        on_progress=seen.append,
    )
    stages = [p.stage for p in seen]
    assert stages[0] == "load" and stages[-1] == "verify"
    assert {"load", "reshard", "save", "verify"} <= set(stages)
    done = [p.tensors_done for p in seen]
    assert done == sorted(done) and done[-1] == seen[-1].tensors_total == 27
    assert max(p.layers_done for p in seen) == 4


def test_cancel_writes_nothing(llama_dir, tmp_path):
    import threading

    from services.converter.job import ConversionCancelled

    cancel = threading.Event()

    def stop_after_first_layer(progress):
        if progress.layers_done == 1:
            cancel.set()

    with pytest.raises(ConversionCancelled):
        convert(
            ConvertOptions("hf", "native", llama_dir, tmp_path / "out"),
            on_progress=stop_after_first_layer,
            cancel=cancel,
        )
    assert _nothing_written(tmp_path)


def test_megatron_files_with_rng_optimizer_and_enum_args_load(llama_dir, tmp_path):
    # What Megatron itself saves beside the model: numpy / Python RNG states, optimizer state,
    # and (newer versions) enums in args. All of it is allowed without a plain unpickle.
    import random

    import numpy as np
    from megatron.core.transformer.enums import AttnBackend

    mg = tmp_path / "mg"
    convert(ConvertOptions("hf", "megatron", llama_dir, mg))
    path = mg / "release" / "mp_rank_00" / "model_optim_rng.pt"
    state = load_file(path)  # memory-mapped: save the edit under a new inode (_save_over)
    state["args"].attention_backend = AttnBackend.auto
    state["rng_state"] = [
        {
            "random_rng_state": random.getstate(),
            "np_rng_state": np.random.get_state(),
            "torch_rng_state": torch.get_rng_state(),
        }
    ]
    state["optimizer"] = {"optimizer": {"state": {0: {"exp_avg": torch.zeros(3)}}}}
    _save_over(state, path)
    report = convert(ConvertOptions("megatron", "hf", mg, tmp_path / "out", verify=True))
    assert report.verify is not None and report.verify.max_abs_logit_diff == 0.0


def test_output_inside_the_source_is_refused(llama_dir, tmp_path):
    with pytest.raises(ValueError, match="lies inside --load-dir"):
        ConvertOptions("hf", "native", llama_dir, llama_dir / "native")
    assert not (llama_dir / "native").exists()
