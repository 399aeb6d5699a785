"""Instruction tuning: packed conversations train exactly like one-by-one ones, and
`meshline train` fine-tunes on the alpaca-style fixture end to end (LoRA, packing)."""

from __future__ import annotations

import json

import pytest
import torch

from kernels.cross_entropy import cross_entropy
from models import build_model
from models.lora import LoraConfig, apply_lora
from models.registry import get_config
from models.tokenizer import build_tokenizer
from services import cli as meshline
from services.preprocess.job import PreprocessConfig, run_preprocess
from tests.fixtures import records as fx
from tokendata.datasets import build_datasets
from tokendata.datasets.config import DataConfig

SEQ = 512


@pytest.fixture(scope="module")
def alpaca_shards(tmp_path_factory, sentencepiece_model):
    """The alpaca fixture (varied a little, 24 records) preprocessed into instruction shards."""
    root = tmp_path_factory.mktemp("alpaca")
    records = [{**r, "output": f"{r['output']} ({i})"} for i in range(8) for r in fx.ALPACA]
    data = fx.write_json_array(root / "alpaca.json", records)
    prefix = root / "alpaca"
    run_preprocess(
        PreprocessConfig(
            input=(str(data),),
            output_prefix=str(prefix),
            tokenizer_type="SentencePiece",
            tokenizer_model=str(sentencepiece_model),
            handler_name="alpaca",
        )
    )
    return prefix


def test_packed_batch_equals_conversations_one_by_one(alpaca_shards, sentencepiece_model):
    """Loss sum and every gradient of a packed row equal the sums over its conversations run
    separately (positions restart, attention blocked across documents). fp32, atol 1e-5."""
    tok = build_tokenizer("SentencePiece", sentencepiece_model)
    config = DataConfig(
        data_path=[str(alpaca_shards)], is_instruction_dataset=True, pack=True, split="1,0,0"
    )
    train, _, _ = build_datasets(config, tok, SEQ, seed=1)
    sample = next(train[i] for i in range(len(train)) if int(train[i]["segment_ids"].max()) >= 3)
    model_config = get_config("tiny-llama", vocab_size=512, max_position_embeddings=SEQ)
    torch.manual_seed(0)
    model = build_model(model_config, device="cpu")
    apply_lora(model, LoraConfig(r=4, target_modules=["qkv_proj", "o_proj", "down_proj"]), seed=1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    trainable = [p for p in model.parameters() if p.requires_grad]

    ids, labels, segments = sample["input_ids"], sample["labels"], sample["segment_ids"]
    logits = model(
        ids[None], position_ids_BS=sample["position_ids"][None], segment_ids_BS=segments[None]
    )
    packed = cross_entropy(logits, labels[None], reduction="sum")
    packed_grads = torch.autograd.grad(packed, trainable)

    separate = torch.zeros(())
    for seg in segments.unique().tolist():
        if seg == 0:
            assert (labels[segments == 0] == -100).all()  # padding never carries loss
            continue
        keep = segments == seg
        doc_logits = model(ids[keep][None])
        separate = separate + cross_entropy(doc_logits, labels[keep][None], reduction="sum")
    separate_grads = torch.autograd.grad(separate, trainable)
    assert abs(packed.item() - separate.item()) <= 1e-5 * max(1.0, abs(separate.item()))
    for a, b in zip(packed_grads, separate_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_meshline_train_finetunes_alpaca(alpaca_shards, sentencepiece_model, tmp_path):
    """`meshline train` with LoRA (+ a trained head) on packed instruction shards: the response
    loss falls and the adapters are exported."""
    argv = [
        "train", "--model", "tiny-llama", "--data-path", str(alpaca_shards), "--split", "1,0,0",
        "--tokenizer-type", "SentencePiece", "--tokenizer-model", str(sentencepiece_model),
        "--is-instruction-dataset", "--pack", "--variable-seq-lengths", "--seq-length", str(SEQ), "--micro-batch-size", "2",
        "--max-position-embeddings", str(SEQ),
        "--train-iters", "12", "--lr", "3e-2", "--lr-warmup-iters", "2", "--eval-interval", "0",
        "--log-interval", "4", "--lora-target-modules", "query_key_value", "dense",
        "dense_h_to_4h", "dense_4h_to_h", "--lora-r", "8", "--lora-alpha", "16", "--lora-modules-to-save", "lm_head",
        "--save", str(tmp_path / "ckpt"), "--log-dir", str(tmp_path / "logs"),
    ]  # fmt: skip
    assert meshline.main(argv) == 0
    summary = json.loads((tmp_path / "logs" / "summary.json").read_text())
    assert summary["final_loss"] < 0.9 * summary["first_loss"], summary
    adapter = tmp_path / "ckpt" / "adapter"
    assert (adapter / "adapter_model.safetensors").is_file()
    assert json.loads((adapter / "adapter_config.json").read_text())["r"] == 8
