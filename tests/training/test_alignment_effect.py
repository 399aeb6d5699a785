"""The effect of preference training, checked from outside the trainer (issue #38's "Done when").

A short DPO run on a learnable synthetic preference (the chosen reply names a colour, the rejected
one refuses), its policy and reference exported by the converter to HF, then scored by
transformers on held-out pairs (prompts the run never saw): the chosen reply must become more
likely relative to the reference than the rejected one for >= 90% of them.
"""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from services.converter.job import convert
from services.converter.options import ConvertOptions
from services.preprocess.job import PreprocessConfig, run_preprocess
from services.trainer.arguments import parse_args
from tests.fixtures import records as fx
from tests.training.test_alignment_train import COLOURS, _flags
from tokendata.datasets.pairwise import PairSource
from training.launch_checks import check_paths
from training.loop import Trainer


def _preprocess(directory, sentencepiece_model, numbers: range) -> str:
    records = [
        {
            "prompt": f"Question {i}: name a colour.",
            "chosen": f" The colour is {COLOURS[i % len(COLOURS)]}.",
            "rejected": " No, I will not.",
        }
        for i in numbers
    ]
    path = fx.write_jsonl(directory / f"pairs-{numbers.start}.jsonl", records)
    prefix = directory / f"pairs-{numbers.start}"
    run_preprocess(
        PreprocessConfig(
            input=(str(path),),
            output_prefix=str(prefix),
            tokenizer_type="SentencePiece",
            tokenizer_model=str(sentencepiece_model),
            handler_name="preference",
            seq_length=32,
        )
    )
    return str(prefix)


def _response_logps(model, ids: list[int], labels: list[int]) -> float:
    """transformers' summed log-probability of the labelled (response) tokens."""
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        logps = torch.log_softmax(model(input_ids).logits[0, :-1].double(), dim=-1)
    target = torch.tensor(labels[1:])
    keep = target != -100
    return float(logps[keep].gather(-1, target[keep, None]).sum())


@pytest.mark.slow
def test_dpo_policy_exported_to_hf_prefers_the_chosen_replies_on_held_out_pairs(
    sentencepiece_model, tmp_path
):
    train = _preprocess(tmp_path, sentencepiece_model, range(0, 64))
    held_out = PairSource(_preprocess(tmp_path, sentencepiece_model, range(200, 240)))
    flags = _flags(sentencepiece_model, train, "dpo", "--split", "100,0,0", "--dpo-beta", "0.5")
    start = tmp_path / "start"
    Trainer(parse_args([*flags, "--save", str(start)])).save()  # the reference: step 0
    policy = tmp_path / "dpo"
    Trainer(parse_args([*flags, "--ref-model", str(start), "--save", str(policy)])).fit()
    exported = {}
    for name, directory in (("reference", start), ("policy", policy)):
        exported[name] = tmp_path / f"hf-{name}"
        convert(ConvertOptions("native", "hf", directory, exported[name], dtype="fp32"))
    models = {
        name: AutoModelForCausalLM.from_pretrained(path).eval() for name, path in exported.items()
    }
    wins = 0
    for index in range(len(held_out)):
        pair = held_out.pair(index)
        ratio = {}
        for side in ("chosen", "rejected"):
            ids = pair[f"{side}_input_ids"].tolist()
            labels = pair[f"{side}_labels"].tolist()
            scores = {name: _response_logps(m, ids, labels) for name, m in models.items()}
            ratio[side] = scores["policy"] - scores["reference"]
        wins += ratio["chosen"] > ratio["rejected"]
    assert len(held_out) == 40
    assert wins >= 0.9 * len(held_out), f"{wins}/{len(held_out)} held-out pairs"


def _reward_run(tmp_path, sentencepiece_model, iters: str):
    """(trainer, HF export directory, resume flags) of a --stage rm run on the colour preference."""
    train = _preprocess(tmp_path, sentencepiece_model, range(0, 64))
    flags = _flags(sentencepiece_model, train, "rm", "--split", "100,0,0", "--train-iters", iters)
    save = tmp_path / "rm"
    trainer = Trainer(parse_args([*flags, "--save", str(save)]))
    trainer.fit()
    exported = tmp_path / "hf-rm"
    convert(ConvertOptions("native", "hf", save, exported, dtype="fp32"))
    return trainer, exported, [*flags, "--load", str(save)]


def test_reward_model_exported_to_hf_scores_as_meshline(sentencepiece_model, tmp_path):
    """transformers' AutoModelForSequenceClassification reads the export; its score of each
    (right-padded) sequence equals Meshline's reward for it."""
    from transformers import AutoModelForSequenceClassification

    from training.objectives.base import ForwardContext
    from training.objectives.rm import pair_rewards

    trainer, exported, resume = _reward_run(tmp_path, sentencepiece_model, "2")
    saved = json.loads((tmp_path / "rm" / "step-000002" / "config.json").read_text())
    assert saved["value_head"] is True and saved["tie_word_embeddings"] is False
    check_paths(parse_args([*resume, "--train-iters", "3"]))  # the rm run resumes
    with pytest.raises(ValueError, match="the source is a reward model"):
        convert(ConvertOptions("native", "gguf", tmp_path / "rm", tmp_path / "gg"))
    # Megatron (MindSpeed-LLM's rm_head, here over TP2 x PP2) and back keeps the head exactly.
    mg = tmp_path / "mg"
    convert(ConvertOptions("native", "megatron", tmp_path / "rm", mg, target_tp=2, target_pp=2))
    convert(ConvertOptions("megatron", "hf", mg, tmp_path / "hf-via-mg", dtype="fp32"))
    from safetensors.torch import load_file

    direct = load_file(exported / "model.safetensors")
    via_megatron = load_file(tmp_path / "hf-via-mg" / "model.safetensors")
    assert direct.keys() == via_megatron.keys() and "score.weight" in direct
    for name, tensor in direct.items():
        assert torch.equal(tensor, via_megatron[name]), name
    back = tmp_path / "native-again"  # HF -> native keeps the head
    convert(ConvertOptions("hf", "native", exported, back, dtype="fp32"))
    assert json.loads((back / "step-000000" / "config.json").read_text())["value_head"] is True
    from engine.loading import load_checkpoint

    with pytest.raises(ValueError, match=r"a reward model .* cannot generate"):
        load_checkpoint(exported)  # the engine refuses it before reading a weight
    config = json.loads((exported / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"]
    hf = AutoModelForSequenceClassification.from_pretrained(exported).eval()
    assert hf.config.num_labels == 1
    pad = hf.config.pad_token_id
    assert pad is not None and pad != hf.config.eos_token_id
    # Right-padded rows of different lengths (with the pad id Meshline's data uses): HF finds
    # each row's last non-pad token, Meshline its last attended one; the scores must agree.
    sample = trainer.train_data[0]
    lengths = [9, 17, 25, 32]
    ids = torch.full((len(lengths), 32), pad)
    attention = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, :length] = sample["chosen_input_ids"][:length]
        attention[row, :length] = 1
    assert int(sample["chosen_attention_mask"].sum()) == 32 and (ids != pad).sum() == sum(lengths)
    batch = {f"{side}_{key}": value for side in ("chosen", "rejected")
             for key, value in (("input_ids", ids), ("attention_mask", attention))}  # fmt: skip
    ctx = ForwardContext(autocast=contextlib.nullcontext)
    with torch.no_grad():
        ours, _ = pair_rewards(trainer.model.eval(), batch, ctx)
        theirs = hf(input_ids=ids, attention_mask=attention).logits[:, 0]
    assert (theirs - ours).abs().max().item() <= 1e-5
    assert ours.std() > 0  # the rows score differently: each one's own last token was read


@pytest.mark.slow
def test_reward_model_exported_to_hf_ranks_held_out_pairs(sentencepiece_model, tmp_path):
    """A reward model trained with --stage rm, exported and scored by transformers, ranks >= 90%
    of held-out pairs (prompts it never saw) correctly."""
    from transformers import AutoModelForSequenceClassification

    _, exported, _ = _reward_run(tmp_path, sentencepiece_model, "12")
    hf = AutoModelForSequenceClassification.from_pretrained(exported).eval()
    held_out = PairSource(_preprocess(tmp_path, sentencepiece_model, range(400, 440)))
    right = 0
    with torch.no_grad():
        for index in range(len(held_out)):
            pair = held_out.pair(index)
            score = {
                side: hf(input_ids=torch.tensor([pair[f"{side}_input_ids"].tolist()])).logits[0, 0]
                for side in ("chosen", "rejected")
            }
            right += bool(score["chosen"] > score["rejected"])
    assert len(held_out) == 40
    assert right >= 0.9 * len(held_out), f"{right}/{len(held_out)} held-out pairs"
