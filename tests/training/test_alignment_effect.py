"""The effect of preference training, checked from outside the trainer (issue #38's "Done when").

A short DPO run on a learnable synthetic preference (the chosen reply names a colour, the rejected
one refuses), its policy and reference exported by the converter to HF, then scored by
transformers on held-out pairs (prompts the run never saw): the chosen reply must become more
likely relative to the reference than the rejected one for >= 90% of them.
"""

from __future__ import annotations

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
