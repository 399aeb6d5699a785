"""DeepSpeed ZeRO-1/2/3 checkpoints written by DeepSpeed itself (0.19.8 on its CPU accelerator, 2
gloo ranks, `deepspeed_writer.py`) consolidate to the engine's fp32 master weights bit for bit,
exactly as DeepSpeed's own zero_to_fp32 does, and `--load-format deepspeed` converts them to HF
checkpoints with identical logits; so do the universal checkpoints deepspeed's ds_to_universal
makes of them; broken or foreign files are refused."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from checkpoints.deepspeed_format import DeepSpeedSource
from checkpoints.deepspeed_format import load_file as load_deepspeed
from checkpoints.deepspeed_universal import UniversalSource, universal_tag
from services.converter import cli
from services.converter.job import ConvertOptions, convert
from tests.services.converter.deepspeed_writer import CASES, STEPS, VOCAB, bloom, llama

STAGES = {name: int(case.zero["stage"]) for name, case in CASES.items()}


def _zero_to_fp32(directory: Path) -> dict[str, torch.Tensor]:
    """DeepSpeed's own consolidation (deepspeed.utils.zero_to_fp32) of the checkpoint."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(directory))


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("case", list(CASES))
def test_consolidates_bit_for_bit_and_converts_to_hf(case, deepspeed_checkpoints, tmp_path):
    source_dir = deepspeed_checkpoints / case
    source = DeepSpeedSource(source_dir, None)
    assert (source.zero_stage, source.iteration) == (STAGES[case], STEPS)
    consolidated = source.full_state_dict()

    reference = _zero_to_fp32(source_dir)
    assert sorted(consolidated) == sorted(reference)  # a tied head comes from shared_params
    for name, tensor in reference.items():
        assert consolidated[name].dtype == torch.float32
        assert torch.equal(consolidated[name], tensor.float()), name
    engine = load_file(source_dir / "expected.safetensors")
    assert sorted(engine) == sorted(consolidated)
    if not CASES[case].zero.get("round_robin_gradients"):
        # (DeepSpeed's safe_get_full_fp32_param returns other parameters' values under
        # round_robin_gradients; there the low-precision module weights below are the check.)
        for name, tensor in engine.items():
            assert torch.equal(consolidated[name], tensor), name
    if STAGES[case] < 3:  # ZeRO-1/2 save the module's (bf16 or fp32) weights too
        module = load_deepspeed(source.tag_dir / "mp_rank_00_model_states.pt")["module"]
        for name, tensor in module.items():
            if name in consolidated:
                assert torch.equal(consolidated[name].to(tensor.dtype), tensor), name

    out = tmp_path / "hf"
    report = convert(ConvertOptions("deepspeed", "hf", source_dir, out, verify=True))
    assert report.verify is not None and report.verify.max_abs_logit_diff == 0
    written = load_file(out / "model.safetensors")
    for name, tensor in written.items():
        assert torch.equal(tensor, consolidated[name]), name
    model = llama() if CASES[case].family == "llama" else bloom()
    model.load_state_dict(consolidated)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        converted = AutoModelForCausalLM.from_pretrained(out).eval()
        assert torch.equal(converted(ids).logits, model.eval()(ids).logits)


def two_tags(deepspeed_checkpoints: Path, directory: Path) -> Path:
    """The ZeRO-2 checkpoint (`latest`: global_step2) plus the ZeRO-3 one of the same Llama as
    tag global_step1 beside it."""
    shutil.copytree(deepspeed_checkpoints / "zero2", directory)
    zero3 = deepspeed_checkpoints / "zero3-subgroups-frozen" / f"global_step{STEPS}"
    shutil.copytree(zero3, directory / "global_step1")
    return directory


@pytest.mark.slow
@pytest.mark.dist
def test_tag_directory_iteration_and_megatron_output(deepspeed_checkpoints, tmp_path):
    ds = two_tags(deepspeed_checkpoints, tmp_path / "ds")
    # `latest` names step 2; --load-iteration (and a tag directory) pick step 1.
    assert DeepSpeedSource(ds, None).iteration == 2
    assert DeepSpeedSource(ds, None, iteration=1).zero_stage == 3
    assert DeepSpeedSource(ds / "global_step1", None).zero_stage == 3
    alone = tmp_path / "alone" / "global_step1"  # no config.json beside it: --model needed
    shutil.copytree(ds / "global_step1", alone)
    with pytest.raises(FileNotFoundError, match="pass --model NAME"):
        DeepSpeedSource(alone, None)
    argv = [
        "--load-format", "deepspeed", "--save-format", "megatron",
        "--load-dir", str(ds), "--save-dir", str(tmp_path / "mg"),
        "--load-iteration", "1", "--target-tensor-parallel-size", "1", "--verify",
    ]  # fmt: skip
    assert cli.main(argv) == 0
    assert (tmp_path / "mg" / "latest_checkpointed_iteration.txt").read_text().strip() == "1"


def test_save_format_deepspeed_is_refused(tmp_path):
    with pytest.raises(ValueError, match="--save-format 'deepspeed'"):
        ConvertOptions("hf", "deepspeed", tmp_path, tmp_path / "out")


@pytest.mark.slow
@pytest.mark.dist
def test_missing_rank_and_foreign_objects_are_refused(deepspeed_checkpoints, tmp_path):
    source_dir = deepspeed_checkpoints / "zero2"
    tag = source_dir / f"global_step{STEPS}"

    def broken(name: str) -> Path:
        copy = tmp_path / name
        shutil.copytree(source_dir, copy)
        return copy / tag.name

    missing = broken("missing")
    (missing / "zero_pp_rank_0_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(FileNotFoundError, match=r"DP ranks \[1\]"):
        DeepSpeedSource(missing.parent, None)

    fewer = broken("fewer")
    (fewer / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(ValueError, match=r"partition_count \[2\] but 1"):
        DeepSpeedSource(fewer.parent, None)

    truncated = broken("truncated")
    victim = truncated / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    victim.write_bytes(victim.read_bytes()[:2000])
    with pytest.raises(ValueError, match=r"zero_pp_rank_1.*truncated"):
        convert(ConvertOptions("deepspeed", "hf", truncated.parent, tmp_path / "out"))
    assert not (tmp_path / "out").exists()

    pipeline = broken("pipeline")
    (pipeline / "layer_01-model_00-model_states.pt").write_bytes(b"")
    with pytest.raises(ValueError, match="pipeline-parallel checkpoint"):
        DeepSpeedSource(pipeline.parent, None)

    # An object outside the allow-list (here a builtin with a harmful reduce) is never unpickled.
    evil = broken("evil")
    state = load_deepspeed(tag / "mp_rank_00_model_states.pt")
    state["client_state"] = shutil.rmtree
    torch.save(state, evil / "mp_rank_00_model_states.pt")
    with pytest.raises(ValueError, match=r"refused to load; it holds shutil\.rmtree"):
        DeepSpeedSource(evil.parent, None)


UNIVERSAL = [name for name, case in CASES.items() if case.universal]


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("case", UNIVERSAL)
def test_universal_checkpoints_read_bit_for_bit(case, deepspeed_checkpoints, tmp_path):
    """ds_to_universal's output (per-parameter fp32 folders) of the ZeRO-2 and ZeRO-3 saves:
    the engine's fp32 master weights, found through `latest_universal` or the tag folder."""
    universal = deepspeed_checkpoints / f"{case}-universal"
    tag = universal_tag(universal)
    assert tag == universal / f"global_step{STEPS}" == universal_tag(tag)
    assert universal_tag(universal, iteration=STEPS) == tag
    assert universal_tag(deepspeed_checkpoints / case) is None  # a ZeRO checkpoint
    source = UniversalSource(tag, None)
    assert source.iteration == STEPS
    engine = load_file(deepspeed_checkpoints / case / "expected.safetensors")
    state = source.full_state_dict()
    assert sorted(state) == sorted(engine)  # the tied head from shared_params
    for name, tensor in engine.items():
        assert torch.equal(state[name], tensor), name

    out = tmp_path / "hf"
    report = convert(ConvertOptions("deepspeed", "hf", universal, out, verify=True))
    assert report.verify is not None and report.verify.max_abs_logit_diff == 0
    model = llama() if CASES[case].family == "llama" else bloom()
    model.load_state_dict(engine)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        converted = AutoModelForCausalLM.from_pretrained(out).eval()
        assert torch.equal(converted(ids).logits, model.eval()(ids).logits)


@pytest.mark.slow
@pytest.mark.dist
def test_broken_universal_checkpoints_are_refused(deepspeed_checkpoints, tmp_path):
    def copy(name: str) -> Path:
        shutil.copytree(deepspeed_checkpoints / "zero2-universal", tmp_path / name)
        return tmp_path / name / f"global_step{STEPS}"

    norm = "model.norm.weight"
    missing = copy("missing")
    (missing / "zero" / norm / "fp32.pt").unlink()
    with pytest.raises(FileNotFoundError, match=f"no fp32.pt for '{norm}'"):
        UniversalSource(missing, None)

    resized = copy("resized")
    torch.save({"param": torch.zeros(3), "cat_dim": 0}, resized / "zero" / norm / "fp32.pt")
    with pytest.raises(ValueError, match=r"3 elements, its shape \(54,\)"):
        UniversalSource(resized, None).full_state_dict()

    # A parameter name is a path component only when it is one plain file name.
    escaping = copy("escaping")
    original = deepspeed_checkpoints / "zero2-universal" / escaping.name
    state = load_deepspeed(original / "mp_rank_00_model_states.pt")  # memory-mapped: not the copy
    state["param_shapes"][0]["../../outside"] = torch.Size([2])
    torch.save(state, escaping / "mp_rank_00_model_states.pt")
    with pytest.raises(FileNotFoundError, match=r"no fp32.pt for '\.\./\.\./outside'"):
        UniversalSource(escaping, None)

    pointer = copy("pointer").parent
    (pointer / "latest_universal").write_text("../zero2-universal")
    with pytest.raises(FileNotFoundError, match="not a universal checkpoint folder"):
        universal_tag(pointer)
