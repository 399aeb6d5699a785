"""DeepSpeed ZeRO-1/2/3 checkpoints (DeepSpeed's own file layout, written by deepspeed_layout.py)
consolidate to the original fp32 weights bit for bit at DP 2 and 4, and `--load-format deepspeed`
converts them to HF checkpoints with identical logits; broken or foreign files are refused."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file
from transformers import (
    AutoModelForCausalLM,
    BloomConfig,
    BloomForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
)

from checkpoints.deepspeed_format import DeepSpeedSource
from checkpoints.deepspeed_format import load_file as load_deepspeed
from services.converter import cli
from services.converter.job import ConvertOptions, convert
from tests.services.converter.deepspeed_layout import ZeroLayout, write_zero_checkpoint

VOCAB = 203


def _randomise(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    return model.eval()


def _llama() -> LlamaForCausalLM:
    """Sizes that are not multiples of 4 (54 hidden, 50 ffn, 203 vocab), so ZeRO pads."""
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=54,
        intermediate_size=50,
        num_hidden_layers=2,
        num_attention_heads=3,
        num_key_value_heads=1,
        max_position_embeddings=32,
    )
    return _randomise(LlamaForCausalLM(config), seed=3)


def _bloom() -> BloomForCausalLM:
    """Odd sizes (45 hidden: norms and biases of odd length) and a tied output head."""
    config = BloomConfig(vocab_size=VOCAB, hidden_size=45, n_layer=2, n_head=3)
    return _randomise(BloomForCausalLM(config), seed=4)


LAYOUTS = {
    "zero2-dp2": ("llama", ZeroLayout(stage=2, world=2)),
    "zero2-dp4-aligned-roundrobin-frozen": (
        "llama",
        ZeroLayout(
            stage=2,
            world=4,
            param_alignment=8,
            round_robin=True,
            frozen=("model.embed_tokens.weight",),
        ),
    ),
    "zero1-dp4-bf16-optimizer": ("llama", ZeroLayout(stage=1, world=4, bf16_optimizer=True)),
    "zero3-dp2-tied": ("bloom", ZeroLayout(stage=3, world=2)),
    "zero3-dp4-subgroups-frozen": (
        "llama",
        ZeroLayout(stage=3, world=4, sub_group_size=6000, frozen=("model.norm.weight",)),
    ),
    "zero3-dp4-tied": ("bloom", ZeroLayout(stage=3, world=4)),
}


def _checkpoint(family: str, layout: ZeroLayout, directory):
    """An HF Trainer-style checkpoint directory: config.json beside DeepSpeed's `latest`."""
    model = _llama() if family == "llama" else _bloom()
    model.config.save_pretrained(directory)
    write_zero_checkpoint(model, directory, layout)
    return model


@pytest.mark.parametrize("case", list(LAYOUTS))
def test_consolidates_bit_for_bit_and_converts_to_hf(case, tmp_path):
    family, layout = LAYOUTS[case]
    source_dir = tmp_path / "ds"
    model = _checkpoint(family, layout, source_dir)
    original = model.state_dict()

    source = DeepSpeedSource(source_dir, None)
    assert (source.zero_stage, source.iteration) == (layout.stage, 12)
    consolidated = source.full_state_dict()
    assert sorted(consolidated) == sorted(original)  # a tied head comes from shared_params
    for name, tensor in original.items():
        assert consolidated[name].dtype == torch.float32
        assert torch.equal(consolidated[name], tensor), name

    out = tmp_path / "hf"
    report = convert(ConvertOptions("deepspeed", "hf", source_dir, out, verify=True))
    assert report.verify is not None and report.verify.max_abs_logit_diff == 0
    written = load_file(out / "model.safetensors")
    for name, tensor in written.items():
        assert torch.equal(tensor, original[name]), name
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        converted = AutoModelForCausalLM.from_pretrained(out).eval()
        assert torch.equal(converted(ids).logits, model(ids).logits)


def test_tag_directory_iteration_and_megatron_output(tmp_path):
    _checkpoint("llama", ZeroLayout(stage=3, world=2), tmp_path / "ds")
    write_zero_checkpoint(_llama(), tmp_path / "ds", ZeroLayout(stage=2, world=2), step=20)
    # `latest` now names step 20; --load-iteration (and a tag directory) pick step 12.
    assert DeepSpeedSource(tmp_path / "ds", None).iteration == 20
    assert DeepSpeedSource(tmp_path / "ds", None, iteration=12).zero_stage == 3
    assert DeepSpeedSource(tmp_path / "ds" / "global_step12", None).zero_stage == 3
    alone = tmp_path / "alone" / "global_step12"  # no config.json beside it: --model needed
    shutil.copytree(tmp_path / "ds" / "global_step12", alone)
    with pytest.raises(FileNotFoundError, match="pass --model NAME"):
        DeepSpeedSource(alone, None)
    argv = [
        "--load-format", "deepspeed", "--save-format", "megatron",
        "--load-dir", str(tmp_path / "ds"), "--save-dir", str(tmp_path / "mg"),
        "--load-iteration", "12", "--target-tensor-parallel-size", "1", "--verify",
    ]  # fmt: skip
    assert cli.main(argv) == 0
    assert (tmp_path / "mg" / "latest_checkpointed_iteration.txt").read_text().strip() == "12"


def test_save_format_deepspeed_is_refused(tmp_path):
    with pytest.raises(ValueError, match="--save-format 'deepspeed'"):
        ConvertOptions("hf", "deepspeed", tmp_path, tmp_path / "out")


def test_missing_rank_and_foreign_objects_are_refused(tmp_path):
    source_dir = tmp_path / "ds"
    _checkpoint("llama", ZeroLayout(stage=2, world=4), source_dir)
    tag = source_dir / "global_step12"

    broken = tmp_path / "missing"
    shutil.copytree(source_dir, broken)
    (broken / "global_step12" / "zero_pp_rank_2_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(FileNotFoundError, match=r"DP ranks \[0, 1, 3\]"):
        DeepSpeedSource(broken, None)

    fewer = tmp_path / "fewer"
    shutil.copytree(source_dir, fewer)
    (fewer / "global_step12" / "zero_pp_rank_3_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(ValueError, match=r"partition_count \[4, 4\] but 3"):
        DeepSpeedSource(fewer, None)

    truncated = tmp_path / "truncated"
    shutil.copytree(source_dir, truncated)
    victim = truncated / "global_step12" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    victim.write_bytes(victim.read_bytes()[:2000])
    with pytest.raises(ValueError, match=r"zero_pp_rank_1.*truncated"):
        convert(ConvertOptions("deepspeed", "hf", truncated, tmp_path / "out"))
    assert not (tmp_path / "out").exists()

    pipeline = tmp_path / "pipeline"
    shutil.copytree(source_dir, pipeline)
    (pipeline / "global_step12" / "layer_01-model_00-model_states.pt").write_bytes(b"")
    with pytest.raises(ValueError, match="pipeline-parallel checkpoint"):
        DeepSpeedSource(pipeline, None)

    # An object outside the allow-list (here a builtin with a harmful reduce) is never unpickled.
    evil = tmp_path / "evil"
    shutil.copytree(source_dir, evil)
    state = load_deepspeed(tag / "mp_rank_00_model_states.pt")
    state["client_state"] = shutil.rmtree
    torch.save(state, evil / "global_step12" / "mp_rank_00_model_states.pt")
    with pytest.raises(ValueError, match=r"refused to load; it holds shutil\.rmtree"):
        DeepSpeedSource(evil, None)
