"""One MoE checkpoint through every stage (issue #17): train → convert → serve → evaluate.

`tiny-mixtral` (a Llama config whose every MLP is a mixture of experts) trains for a few steps
with expert parallelism EP2 on 2 gloo processes, with a SentencePiece tokenizer trained here; the
converter writes it in HF Mixtral layout (verified); Meshline's InferenceService serves the export
on localhost; the evaluator runs a BoolQ task file written here through the served endpoint and,
in-process, on the training checkpoint itself. The scores and every log-likelihood must equal
those of transformers' own `MixtralForCausalLM` on the export, scored by lm-evaluation-harness.
"""

from __future__ import annotations

import json

import pytest
import torch

from models.tokenizer import train_sentencepiece
from services.converter.job import ConvertOptions, convert
from services.evaluator.models.grpc_client import GrpcLanguageModel
from services.evaluator.models.local import LocalLanguageModel
from services.evaluator.results import write_results
from services.evaluator.runner import EvalConfig, evaluate
from tests.fixtures.tokenizers import training_text
from tests.harness import run_distributed
from tests.services.evaluator.servers import inference_server

STEPS = 3
FLAGS = ["--model", "tiny-mixtral", "--num-layers", "2", "--mock-data", "--seq-length", "32",
         "--micro-batch-size", "2", "--global-batch-size", "4", "--eval-interval", "0",
         "--lr", "1e-2", "--log-interval", "1000", "--train-iters", str(STEPS),
         "--expert-model-parallel-size", "2", "--tokenizer-type", "SentencePiece",
         "--vocab-size", "512"]  # fmt: skip

BOOLQ = [
    ("The Sun is the star at the center of the Solar System.", "is the sun a star", True),
    ("Botanically, a tomato is a fruit of a flowering plant.", "is a tomato a vegetable", False),
    ("Cats have long whiskers on their muzzle that sense touch.", "do cats have whiskers", True),
    ("Ice is frozen water; steam is water above its boiling point.", "is ice hotter than steam", False),
]  # fmt: skip
"""(passage, question, answer) of the task file the evaluator reads."""


def _train_ep2(rank, world_size, save, tokenizer):
    from services.trainer.arguments import parse_args
    from training.loop import Trainer

    flags = [*FLAGS, "--tokenizer-model", tokenizer, "--save", save]
    trainer = Trainer(parse_args(flags))
    losses = [trainer.train_step().loss for _ in range(STEPS)]
    trainer.save()
    trainer.checkpoints.wait()
    return losses, trainer.model_config.to_dict()


def _write_task(root):
    """A BoolQ task directory (dev split, the evaluator's published-file layout)."""
    (root / "boolq").mkdir(parents=True)
    rows = [{"passage": p, "question": q, "answer": a, "title": q.split()[-1]} for p, q, a in BOOLQ]
    (root / "boolq" / "dev.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "boolq" / "train.jsonl").write_text(json.dumps(rows[0]) + "\n")
    return root


def _tokenizer(root):
    """A SentencePiece model (512 pieces) saved as tokenizer.model, the HF file name."""
    root.mkdir(parents=True)
    corpus = root / "corpus.txt"
    corpus.write_text(training_text(), encoding="utf-8")
    return train_sentencepiece([corpus], root / "tokenizer", 512)


def _samples(directory):
    return [
        json.loads(line) for line in (directory / "samples_boolq.jsonl").read_text().splitlines()
    ]


@pytest.mark.dist
@pytest.mark.slow
def test_moe_checkpoint_trains_converts_serves_and_evaluates(tmp_path):
    tokenizer = _tokenizer(tmp_path / "sp")
    assert tokenizer.name == "tokenizer.model"
    save = tmp_path / "run"
    (losses, saved_config), _ = run_distributed(_train_ep2, 2, str(save), str(tokenizer))
    assert saved_config["moe"]["num_experts"] == 4  # the typed field, as config.json has it
    assert losses[-1] < losses[0]

    hf_dir = tmp_path / "hf"
    report = convert(ConvertOptions("native", "hf", save, hf_dir))
    assert report.verify is not None and report.verify.max_abs_logit_diff == 0.0
    written = json.loads((hf_dir / "config.json").read_text())
    assert written["architectures"] == ["MixtralForCausalLM"]
    assert written["num_local_experts"] == 4 and written["num_experts_per_tok"] == 2
    assert (hf_dir / "tokenizer.model").is_file()

    tasks = _write_task(tmp_path / "tasks")
    server = inference_server(hf_dir)
    try:
        served = GrpcLanguageModel(server.address, batch_size=4)
        config = EvalConfig(tasks=("boolq",), task_data_path=tasks, output_path=tmp_path / "e1")
        (outcome,) = evaluate(config, served)
        served.close()
    finally:
        server.stop()
    _, document = write_results(tmp_path / "e1", [outcome], {"model": "served-moe"}, 0.0)
    accuracy = document["results"]["boolq"]["acc,none"]
    assert accuracy == outcome.scores["acc,none"]
    samples = _samples(tmp_path / "e1")
    assert len(samples) == len(BOOLQ)

    # The in-process engine on the training checkpoint (no conversion) scores the same. It is
    # given the export's tokenizer: the export carries tokenizer_config.json, so it is read
    # through transformers, while the native step holds only tokenizer.model, read by
    # SentencePiece itself, and the two split some words differently (a tokenizer matter, not
    # the model's; the weights give equal logits).
    local = LocalLanguageModel(save, load_format="native", tokenizer=hf_dir, batch_size=4)
    config = EvalConfig(tasks=("boolq",), task_data_path=tasks, output_path=tmp_path / "e2")
    (again,) = evaluate(config, local)
    write_results(tmp_path / "e2", [again], {"model": "local-moe"}, 0.0)
    assert again.scores["acc,none"] == accuracy
    in_process = [tuple(r) for sample in _samples(tmp_path / "e2") for r in sample["resps"]]
    served_resps = [tuple(r) for sample in samples for r in sample["resps"]]
    for (lp, greedy), (lp_local, greedy_local) in zip(served_resps, in_process, strict=True):
        assert lp == pytest.approx(lp_local, abs=1e-4) and greedy == greedy_local

    # Reference: transformers' MixtralForCausalLM and tokenizer as a HF user loads the export
    # (AutoTokenizer, as the service does), scored by lm-eval's HFLM.
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoTokenizer, MixtralForCausalLM

    hf = MixtralForCausalLM.from_pretrained(hf_dir, attn_implementation="eager").eval()
    hf_tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
    reference = HFLM(
        pretrained=hf, tokenizer=hf_tokenizer, batch_size=4, max_length=128, add_bos_token=True
    )
    pairs = [tuple(args) for sample in samples for args in sample["arguments"]]
    with torch.no_grad():
        theirs = reference.loglikelihood(
            [Instance("loglikelihood", {}, p, i) for i, p in enumerate(pairs)], disable_tqdm=True
        )
    for (lp, greedy), (ref_lp, ref_greedy) in zip(served_resps, theirs, strict=True):
        assert lp == pytest.approx(ref_lp, abs=1e-3) and greedy == ref_greedy
    # BoolQ's choices are [" no", " yes"]: the reference model's accuracy from its own numbers.
    correct = [
        (theirs[2 * i + 1][0] > theirs[2 * i][0]) == s["doc"]["answer"]
        for i, s in enumerate(samples)
    ]
    assert accuracy == pytest.approx(sum(correct) / len(correct))
    assert [s["metrics"]["acc,none"] for s in samples] == [float(c) for c in correct]
