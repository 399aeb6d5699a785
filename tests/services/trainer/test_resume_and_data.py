"""Checkpoint wiring (bf16 master weights, --finetune) and training on real sentencepiece shards."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from services.trainer.arguments import parse_args
from training.loop import Trainer

BASE = ["--model", "tiny-llama", "--mock-data", "--seq-length", "32", "--micro-batch-size", "2",
        "--eval-interval", "0", "--lr", "1e-2", "--lr-warmup-iters", "1", "--train-iters", "4"]  # fmt: skip


def _params(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def test_bf16_resume_is_bit_identical(tmp_path):
    straight = Trainer(parse_args([*BASE, "--bf16"]))
    for _ in range(4):
        straight.train_step()
    first = Trainer(parse_args([*BASE, "--bf16", "--save", str(tmp_path)]))
    first.train_step(), first.train_step()
    first.save()
    resumed = Trainer(parse_args([*BASE, "--bf16", "--load", str(tmp_path)]))
    assert resumed.load() == 2
    assert resumed.state.step == 2 and resumed.state.consumed_samples == 4
    assert resumed.scheduler.num_steps == 2
    resumed.train_step(), resumed.train_step()
    for name, p in _params(straight).items():
        assert torch.equal(p, _params(resumed)[name]), name
    for a, b in zip(straight.optimizer.master_params, resumed.optimizer.master_params, strict=True):
        assert torch.equal(a, b)


def test_finetune_loads_weights_only(tmp_path):
    source = Trainer(parse_args([*BASE, "--save", str(tmp_path)]))
    source.train_step()
    source.save()
    tuned = Trainer(parse_args([*BASE, "--load", str(tmp_path), "--finetune", "--seed", "99"]))
    tuned.load()
    assert tuned.state.step == 0 and tuned.scheduler.num_steps == 0
    for name, p in _params(source).items():
        assert torch.equal(p, _params(tuned)[name]), name
    assert not tuned.optimizer.inner.state  # optimizer starts fresh


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    from models.tokenizer import build_tokenizer, train_sentencepiece
    from tokendata.indexed import IndexedDatasetWriter, best_dtype

    root = tmp_path_factory.mktemp("corpus")
    words = ["alpha", "beta", "gamma", "delta", "def", "return", "class", "import", "self", "value"]
    rng = np.random.default_rng(0)
    lines = [" ".join(rng.choice(words, size=12)) for _ in range(400)]
    text = root / "corpus.txt"
    text.write_text("\n".join(lines) + "\n")
    model = train_sentencepiece([text], root / "sp", vocab_size=320)
    tokenizer = build_tokenizer("SentencePiece", str(model))
    prefix = str(root / "corpus_text_document")
    writer = IndexedDatasetWriter(prefix, best_dtype(tokenizer.vocab_size))
    for i in range(0, len(lines), 4):
        writer.add_document([*tokenizer.encode(" ".join(lines[i : i + 4])), tokenizer.eod_id])
    writer.finalize()
    return model, prefix


def test_real_shards_train_and_evaluate(shards, tmp_path):
    model, prefix = shards
    flags = [
        "--model", "tiny-llama", "--data-path", prefix, "--split", "90,10,0",
        "--tokenizer-type", "SentencePiece", "--tokenizer-model", str(model),
        "--seq-length", "32", "--micro-batch-size", "4", "--train-iters", "8", "--lr", "5e-3",
        "--log-interval", "4", "--eval-interval", "8", "--eval-iters", "2", "--log-dir", str(tmp_path),
    ]  # fmt: skip
    trainer = Trainer(parse_args(flags))
    assert trainer.model_config.vocab_size == 384  # 320 pieces, padded to a multiple of 128
    summary = trainer.fit()
    assert summary.final_loss < summary.first_loss
    assert summary.val_loss is not None
    assert json.loads(json.dumps(summary.__dict__))["steps"] == 8


def test_bad_split_is_named(shards):
    model, prefix = shards
    flags = ["--model", "tiny-llama", "--data-path", prefix, "--split", "100,0,0", "--tokenizer-type",
             "SentencePiece", "--tokenizer-model", str(model), "--seq-length", "32", "--eval-interval", "5"]  # fmt: skip
    with pytest.raises(ValueError, match="--split 100,0,0"):
        Trainer(parse_args(flags))


def _shard_flags(model, prefix, *extra):
    return ["--model", "tiny-llama", "--tokenizer-type", "SentencePiece", "--tokenizer-model",
            str(model), "--seq-length", "32", "--micro-batch-size", "4", "--train-iters", "2",
            "--lr", "5e-3", "--eval-interval", "0", "--seed", "3", *extra]  # fmt: skip


def test_megatron_document_flags_reach_the_batches(shards, tmp_path):
    model, prefix = shards
    cache = tmp_path / "index-cache"
    flags = _shard_flags(
        model, prefix, "--train-data-path", prefix, "--valid-data-path", prefix,
        "--data-cache-path", str(cache), "--reset-position-ids", "--reset-attention-mask",
        "--eod-mask-loss", "--eval-interval", "2", "--eval-iters", "1",
    )  # fmt: skip
    trainer = Trainer(parse_args(flags))
    assert any(cache.iterdir()), "sample indices are cached under --data-cache-path"
    from models.tokenizer import build_tokenizer
    from tokendata.datasets.gpt import IGNORE_INDEX

    eod = build_tokenizer("SentencePiece", str(model)).eod_id
    # A sample that crosses a document boundary (the fixture's documents are ~50 tokens).
    sample = next(
        s
        for s in map(trainer.train_data.__getitem__, range(20))
        if (s["input_ids"][:-1] == eod).any()
    )
    first = int((sample["input_ids"][:-1] == eod).nonzero()[0, 0])
    assert (
        sample["labels"][first] == IGNORE_INDEX and (sample["labels"][:first] != IGNORE_INDEX).all()
    )
    assert torch.equal(sample["position_ids"][: first + 1], torch.arange(first + 1))
    assert sample["position_ids"][first + 1] == 0
    assert sample["segment_ids"][first] != sample["segment_ids"][first + 1]
    summary = trainer.fit()
    assert summary.val_loss is not None and summary.steps == 2

    # The same data without the flags trains on a different loss: the fields are used.
    plain = Trainer(parse_args(_shard_flags(model, prefix, "--data-path", prefix)))
    assert "segment_ids" not in plain.train_data[0]
    assert plain.train_step().loss != pytest.approx(Trainer(parse_args(flags)).train_step().loss)


def test_per_split_data_flags_are_checked(shards):
    model, prefix = shards
    with pytest.raises(ValueError, match="--valid-data-path / --test-data-path need --train"):
        parse_args(_shard_flags(model, prefix, "--valid-data-path", prefix))
    with pytest.raises(ValueError, match="--data-path and --train-data-path are exclusive"):
        parse_args(_shard_flags(model, prefix, "--data-path", prefix, "--train-data-path", prefix))
    no_valid = _shard_flags(model, prefix, "--train-data-path", prefix, "--eval-interval", "2")
    with pytest.raises(ValueError, match="pass --valid-data-path"):
        Trainer(parse_args(no_valid))


def test_stop_saves_unless_told_not_to(tmp_path):
    kept = Trainer(parse_args([*BASE, "--save", str(tmp_path / "kept")])).fit(stop=lambda: True)
    assert kept.steps == 1 and kept.checkpoint.endswith("step-000001")
    dropped = Trainer(parse_args([*BASE, "--save", str(tmp_path / "dropped")]))
    summary = dropped.fit(stop=lambda: True, save_on_stop=False)
    assert summary.steps == 1 and summary.checkpoint is None
    assert not (tmp_path / "dropped" / "latest").exists()
