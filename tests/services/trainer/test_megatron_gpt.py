"""A Megatron GPT command line (no --position-embedding-type: Megatron's default learned absolute
positions, LayerNorm, exact GeLU, biases) trains through `meshline train`, converts with
`meshline convert` to HF and to Megatron's legacy layout, and transformers' GPT-2 loads the HF
export with the trained model's logits (1e-5)."""

from __future__ import annotations

import json

import torch
from transformers import GPT2LMHeadModel

from checkpoints.megatron_format import load_file as load_megatron
from checkpoints.native_format import NativeSource
from services import cli as meshline
from services.converter.verify import load_model

GPT_FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
             "--seq-length", "32", "--max-position-embeddings", "64",
             "--untie-embeddings-and-output-weights", "--micro-batch-size", "2",
             "--global-batch-size", "4", "--train-iters", "3", "--lr", "1e-3", "--mock-data",
             "--eval-interval", "0", "--log-interval", "1"]  # fmt: skip


def test_megatron_gpt_trains_and_exports_to_transformers_gpt2(tmp_path, capsys):
    run, hf_dir, mg, back = (tmp_path / n for n in ("run", "hf", "mg", "native"))
    assert meshline.main(["train", *GPT_FLAGS, "--save", str(run)]) == 0, capsys.readouterr()
    assert "step 3/3 | loss" in capsys.readouterr().out
    trained = load_model(NativeSource(run)).eval()
    config = trained.config
    assert (config.family, config.position_embedding, config.activation) == (
        "gpt",
        "learned",
        "gelu_exact",
    )
    assert config.max_position_embeddings == 64 and not config.tie_word_embeddings

    convert = ["convert", "--load-format", "native", "--load-dir", str(run)]
    assert meshline.main([*convert, "--save-format", "hf", "--save-dir", str(hf_dir)]) == 0
    hf_config = json.loads((hf_dir / "config.json").read_text())
    assert hf_config["model_type"] == "gpt2" and hf_config["activation_function"] == "gelu"
    hf = GPT2LMHeadModel.from_pretrained(hf_dir, attn_implementation="eager").eval()
    ids = torch.randint(0, config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (hf(ids).logits - trained(ids)).abs().max().item() <= 1e-5

    # Megatron's legacy layout at TP 2 × PP 2 (position table whole on every rank) and back.
    megatron = ["--save-format", "megatron", "--save-dir", str(mg)]
    sizes = ["--target-tensor-parallel-size", "2", "--target-pipeline-parallel-size", "2"]
    assert meshline.main([*convert, *megatron, *sizes]) == 0
    iteration = (mg / "latest_checkpointed_iteration.txt").read_text().strip()
    first = load_megatron(
        mg / f"iter_{int(iteration):07d}" / "mp_rank_01_000" / "model_optim_rng.pt"
    )
    embedding = first["model"]["language_model"]["embedding"]
    assert embedding["position_embeddings"]["weight"].shape == (64, 64)
    assert first["args"].position_embedding_type == "learned_absolute"
    assert not first["args"].swiglu and not first["args"].openai_gelu
    to_native = ["convert", "--load-format", "megatron", "--load-dir", str(mg)]
    assert meshline.main([*to_native, "--save-format", "native", "--save-dir", str(back)]) == 0
    again = load_model(NativeSource(back)).state_dict()
    for name, tensor in trained.state_dict().items():
        assert torch.equal(again[name], tensor), name


def test_megatron_args_that_change_the_math_must_match_the_model():
    """A Megatron checkpoint read with --model: its saved flags (GeLU form, norm, positions,
    SwiGLU) must describe that model, or the reader refuses (`math_mismatches`)."""
    from argparse import Namespace

    from checkpoints.megatron_format import math_mismatches
    from models.registry import get_config

    default = dict(normalization="LayerNorm", position_embedding_type="learned_absolute",
                   swiglu=False, openai_gelu=False)  # fmt: skip
    gpt2 = get_config("gpt2-124M")  # HF GPT-2: the tanh GeLU
    assert math_mismatches(Namespace(**default), gpt2) == [
        "openai_gelu=False but activation='gelu'"
    ]
    assert math_mismatches(Namespace(**{**default, "openai_gelu": True}), gpt2) == []
    assert len(math_mismatches(Namespace(**default), get_config("tiny-llama"))) == 3
