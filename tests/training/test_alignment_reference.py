"""--ref-model, a resumed DPO run, ORPO and DPO under LoRA, end to end on preprocessed pairs.

The reference read from a checkpoint gives the loss curve of the in-memory copy it replaces; a
DPO run resumed with it continues bit for bit; a reference of another model is refused before
any worker starts, naming the field; ORPO learns without a reference; a LoRA policy's reference is
its base (adapters disabled)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from services.trainer.arguments import parse_args
from tests.training.test_alignment_train import _flags, _run, pair_prefix  # noqa: F401
from training.launch_checks import check_model_layout, check_paths
from training.loop import Trainer
from training.objectives.orpo import ORPOLoss


@pytest.fixture(scope="module")
def start_weights(tmp_path_factory, sentencepiece_model, pair_prefix):  # noqa: F811
    """A checkpoint of the weights a --seed 3 run starts from (step 0)."""
    directory = tmp_path_factory.mktemp("start")
    flags = _flags(sentencepiece_model, pair_prefix, "dpo", "--save", str(directory))
    Trainer(parse_args(flags)).save()
    return directory


def _weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in trainer.model.named_parameters()}


def test_ref_model_equals_the_starting_copy_and_a_resumed_run_continues_bit_exactly(
    sentencepiece_model,
    pair_prefix,  # noqa: F811
    start_weights,
    tmp_path,
):
    base = _flags(sentencepiece_model, pair_prefix, "dpo", "--train-iters", "4")
    _, _, copied = _run(base)
    with_ref = [*base, "--ref-model", str(start_weights)]
    check_paths(parse_args(with_ref))
    check_model_layout(parse_args(with_ref), 1)
    save = tmp_path / "dpo"
    full, _, records = _run([*with_ref, "--save", str(save), "--save-interval", "2"])
    assert [r["loss"] for r in records] == [r["loss"] for r in copied]
    assert abs(records[0]["loss"] - math.log(2)) < 1e-5

    resumed_flags = [*with_ref, "--load", str(save / "step-000002"), "--save", str(tmp_path / "r")]
    shutil.copytree(save / "step-000002", tmp_path / "only2" / "step-000002")
    (tmp_path / "only2" / "latest").write_text("2\n")
    resumed_flags[resumed_flags.index("--load") + 1] = str(tmp_path / "only2")
    check_paths(parse_args(resumed_flags))  # resuming DPO is allowed with its reference
    records_resumed: list[dict] = []
    resumed = Trainer(parse_args(resumed_flags), on_metrics=records_resumed.append)
    assert resumed.load() == 2
    resumed.fit()
    assert [r["loss"] for r in records_resumed] == [r["loss"] for r in records[2:]]
    assert [r["objective"] for r in records_resumed] == [r["objective"] for r in records[2:]]
    ours, theirs = _weights(resumed), _weights(full)
    assert all(torch.equal(ours[name], theirs[name]) for name in theirs)


def test_a_reference_of_another_model_is_refused_before_any_worker(
    sentencepiece_model,
    pair_prefix,  # noqa: F811
    start_weights,
    tmp_path,
):
    other = tmp_path / "other"
    shutil.copytree(start_weights, other)
    config_path = other / "step-000000" / "config.json"
    saved = json.loads(config_path.read_text())
    for field, value, message in (
        ("num_layers", saved["num_layers"] + 1, "architecture differs .*num_layers"),
        ("vocab_size", saved["vocab_size"] + 64, "vocabulary differs .*vocab_size"),
    ):
        config_path.write_text(json.dumps(saved | {field: value}))
        config = parse_args(
            _flags(sentencepiece_model, pair_prefix, "dpo", "--ref-model", str(other))
        )
        with pytest.raises(ValueError, match=f"--ref-model {other}: the reference's {message}"):
            check_model_layout(config, 1)
    missing = _flags(sentencepiece_model, pair_prefix, "dpo", "--ref-model", str(tmp_path / "none"))
    with pytest.raises(ValueError, match=r"--ref-model .*none: no such directory"):
        check_paths(parse_args(missing))
    with pytest.raises(ValueError, match="--ref-model only apply to --stage dpo"):
        parse_args(_flags(sentencepiece_model, pair_prefix, "rm", "--ref-model", str(other)))


def test_orpo_run_learns_the_preference_without_a_reference(sentencepiece_model, pair_prefix):  # noqa: F811
    flags = _flags(sentencepiece_model, pair_prefix, "orpo", "--orpo-beta", "0.5")
    trainer, summary, records = _run(flags)
    assert isinstance(trainer.objective, ORPOLoss) and trainer.objective.beta == 0.5
    assert summary.final_loss < summary.first_loss - 1.0  # mostly the NLL of the sequences
    first, last = records[0]["objective"], records[-1]["objective"]
    assert last["log_odds_ratio"] > 0.25 * first["log_odds_ratio"]  # -log σ(odds) shrank 4x
    assert last["rewards/accuracies"] == 1.0 and last["log_odds_chosen"] > 1.0
    assert {"nll_loss", "log_odds_ratio", "log_odds_chosen"} <= set(last)
    with pytest.raises(ValueError, match="--orpo-beta only apply to --stage orpo"):
        parse_args(_flags(sentencepiece_model, pair_prefix, "dpo", "--orpo-beta", "0.2"))


@pytest.mark.slow
def test_dpo_with_lora_takes_the_base_as_its_reference(sentencepiece_model, pair_prefix):  # noqa: F811
    from models.lora import adapters_disabled

    flags = _flags(
        sentencepiece_model, pair_prefix, "dpo", "--lora-target-modules", "query_key_value",
        "dense", "--lora-r", "4", "--lr", "1e-2", "--dpo-beta", "0.5",
    )  # fmt: skip
    trainer, summary, records = _run(flags)
    assert abs(records[0]["loss"] - math.log(2)) < 1e-5  # B = 0: the policy is its base
    assert summary.final_loss < 0.7 * math.log(2)
    assert records[-1]["objective"]["rewards/margins"] > 0
    assert trainer.objective.reference is None  # no second copy of the base was made
    ids = torch.tensor([[1, 5, 9, 13]])
    with torch.no_grad():
        adapted = trainer.model(ids)
        with adapters_disabled(trainer.model):
            base = trainer.model(ids)
        start = Trainer(parse_args(flags)).model(ids)  # the same seed: the untrained base
    assert not torch.equal(adapted, base)
    assert torch.equal(base, start)
    bitfit = parse_args(_flags(sentencepiece_model, pair_prefix, "dpo", "--peft-method", "bitfit"))
    with pytest.raises(ValueError, match="--peft-method with --stage dpo"):
        bitfit.validate(1)
    lora_rm = _flags(sentencepiece_model, pair_prefix, "rm", "--lora-target-modules", "dense")
    with pytest.raises(ValueError, match="--peft-method with --stage rm"):
        parse_args(lora_rm).validate(1)


def test_a_requests_ref_model_is_confined_to_the_data_roots(
    sentencepiece_model,
    pair_prefix,  # noqa: F811
    start_weights,
    tmp_path,
):
    """StartTraining's args: --ref-model is a path setting like --load (resolved under the data
    roots, every file inside checked), so a request cannot make workers read weights elsewhere."""
    from services.common.paths import PermissionDenied
    from services.trainer.request_paths import confine_config

    roots = [start_weights, Path(pair_prefix).parent, sentencepiece_model.parent]
    inside = parse_args(
        _flags(sentencepiece_model, pair_prefix, "dpo", "--ref-model", str(start_weights))
    )
    assert confine_config(inside, roots).run.ref_model == str(start_weights.resolve())
    outside = tmp_path / "elsewhere"
    shutil.copytree(start_weights, outside)
    leaving = parse_args(
        _flags(sentencepiece_model, pair_prefix, "dpo", "--ref-model", str(outside))
    )
    with pytest.raises(PermissionDenied, match="--ref-model"):
        confine_config(leaving, roots)
