"""A small model through Meshline's InferenceService on the fixture subsets, end to end.

Starts a real InferenceService (gRPC on localhost) over a tiny HF Llama checkpoint, evaluates
every benchmark's fixture subset through the gRPC client, and checks: the harness-shaped
results.json and samples; that a Score answer equals the HF model's own log-likelihood of the
same tokens; that a rerun is served entirely from the per-request cache; and the in-process
engine (--load) gives the same scores as the service.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from services.evaluator.models.grpc_client import GrpcLanguageModel
from services.evaluator.models.local import LocalLanguageModel
from services.evaluator.results import format_table, write_results
from services.evaluator.runner import EvalConfig, evaluate
from services.evaluator.sandbox.runner import isolation
from tests.services.evaluator.lm_eval_ref import FIXTURES

UNSAFE_OK = not isolation().available
"""The tiny model's completions are the tests' own: on a host without namespaces they run in
the sandbox's unsafe mode (--allow-unsafe-code-execution) instead of being refused."""

TASKS = (
    "boolq", "mmlu_anatomy", "mmlu_astronomy", "ceval-valid_accountant", "agieval_lsat_ar",
    "agieval_math", "agieval_gaokao_mathcloze", "gsm8k", "gsm8k_cot",
    "bbh_fewshot_boolean_expressions", "humaneval",
)  # fmt: skip


class Counting:
    """Wraps a model and counts the requests that reach it."""

    def __init__(self, model):
        self.model, self.name, self.calls = model, model.name, 0
        self.fingerprint = model.fingerprint
        self.flag, self.is_reward_model = model.flag, model.is_reward_model

    def loglikelihood(self, requests):
        self.calls += len(requests)
        return self.model.loglikelihood(requests)

    def generate_until(self, requests):
        self.calls += len(requests)
        return self.model.generate_until(requests)


def test_fixture_subsets_through_the_service(served, tmp_path):
    checkpoint, server = served
    model = GrpcLanguageModel(server.address, batch_size=4)
    config = EvalConfig(
        tasks=TASKS, task_data_path=FIXTURES, output_path=tmp_path, limit=3, max_new_tokens=12,
        allow_unsafe_code_execution=UNSAFE_OK,
    )  # fmt: skip
    outcomes = evaluate(config, model)
    path, document = write_results(tmp_path, outcomes, {"model": "meshline-grpc"}, 0.0)

    results = document["results"]
    assert set(TASKS) | {"mmlu", "mmlu_stem", "ceval-valid", "agieval", "bbh"} <= set(results)
    assert 0.0 <= results["mmlu_anatomy"]["acc,none"] <= 1.0
    assert "acc_stderr,none" in results["mmlu_anatomy"]
    for name in ("gsm8k", "gsm8k_cot"):
        assert set(results[name]) >= {"exact_match,strict-match", "exact_match,flexible-extract"}
    # AGIEval's group averages acc, the one metric its multiple-choice and cloze subtasks share.
    assert {k for k in results["agieval"] if "," in k} == {"acc,none", "acc_stderr,none"}
    assert document["group_subtasks"]["agieval"] == [
        "agieval_lsat_ar", "agieval_math", "agieval_gaokao_mathcloze",
    ]  # fmt: skip
    assert document["n-shot"]["gsm8k"] == 5 and document["n-shot"]["agieval_math"] == 0
    assert "pass@1,create_test" in results["humaneval"]
    sizes = {"mmlu_anatomy": 3, "mmlu_astronomy": 2}
    expected_mmlu = sum(results[t]["acc,none"] * n for t, n in sizes.items()) / 5
    assert results["mmlu"]["acc,none"] == pytest.approx(expected_mmlu)
    assert document["n-shot"]["mmlu_anatomy"] == 5 and document["n-shot"]["gsm8k_cot"] == 8
    assert document["n-samples"]["boolq"] == {"original": 3, "effective": 3}
    assert document["versions"]["boolq"] == "2.0"
    assert document["group_subtasks"]["mmlu"] == ["mmlu_anatomy", "mmlu_astronomy"]
    assert json.loads(path.read_text()) == json.loads(json.dumps(document, default=str))
    samples = (tmp_path / "samples_mmlu_anatomy.jsonl").read_text().splitlines()
    assert len(samples) == 3
    first = json.loads(samples[0])
    assert len(first["arguments"]) == 4 and len(first["resps"]) == 4
    assert "|mmlu_anatomy|1.0|none|5|acc|" in format_table(document)

    # The service's log-likelihood of a choice equals the HF model's own on the same tokens.
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(checkpoint).eval()
    context, continuation = first["arguments"][0]
    ctx_text = context.rstrip()
    ctx_ids, whole = model.tokenize([ctx_text, context + continuation])
    cont_ids = whole[len(ctx_ids) :]
    ctx_ids = ctx_ids[-(model.context_length - len(cont_ids)) :]
    with torch.no_grad():
        logits = hf(torch.tensor([ctx_ids + cont_ids])).logits[0].log_softmax(-1)
    expected = sum(float(logits[len(ctx_ids) - 1 + i, t]) for i, t in enumerate(cont_ids))
    assert first["resps"][0][0] == pytest.approx(expected, abs=1e-3)

    # Short prompts (no truncation): the same numbers as lm-eval's own HF model on BoolQ, with
    # BOS as Llama tokenizers add it (Meshline adds the tokenizer's BOS when it has one).
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM
    from transformers import LlamaTokenizer

    tokenizer = LlamaTokenizer.from_pretrained(str(checkpoint), legacy=False, add_bos_token=True)
    reference = HFLM(
        pretrained=hf, tokenizer=tokenizer, batch_size=4, max_length=192, add_bos_token=True
    )
    boolq = [
        json.loads(line) for line in (tmp_path / "samples_boolq.jsonl").read_text().splitlines()
    ]
    pairs = [tuple(args) for sample in boolq for args in sample["arguments"]]
    theirs = reference.loglikelihood(
        [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)], disable_tqdm=True
    )
    ours = [tuple(r) for sample in boolq for r in sample["resps"]]
    for (lp, greedy), (ref_lp, ref_greedy) in zip(ours, theirs, strict=True):
        assert lp == pytest.approx(ref_lp, abs=1e-3) and greedy == ref_greedy

    # A rerun is answered from the cache: no request reaches the model, same scores.
    counting = Counting(model)
    again = evaluate(config, counting)
    assert counting.calls == 0
    assert [o.scores for o in again] == [o.scores for o in outcomes]
    model.close()


def test_in_process_engine_matches_the_service(served, tmp_path):
    checkpoint, server = served
    remote = GrpcLanguageModel(server.address, batch_size=4)
    local = LocalLanguageModel(checkpoint, load_format="hf", batch_size=4)
    context = "How many bones are in the adult human body?\nA. 106\nB. 206\nAnswer:"
    choices = [" A", " B", " C", " D"]
    # The choices differ only in their last token and share their context: the local model
    # scores every item in one engine call, the service in Score calls of 4; both must agree.
    tokenized = local.tokenize(choices)
    assert len({tuple(t[:-1]) for t in tokenized}) == 1
    requests = [(context, c) for c in choices]
    requests += [("Question: is the sun a star?\nAnswer:", " yes"), ("Q: 2 + 2 =", " 4")]
    for (lp_remote, g_remote), (lp_local, g_local) in zip(
        remote.loglikelihood(requests), local.loglikelihood(requests), strict=True
    ):
        assert math.isclose(lp_remote, lp_local, abs_tol=1e-4) and g_remote == g_local
    from services.evaluator.models.base import GenerationRequest

    gen = [GenerationRequest("def add(a, b):\n", ("\ndef",), 8)]
    assert remote.generate_until(gen) == local.generate_until(gen)
    remote.close()


def test_rolling_perplexity_windows_match_hf(served):
    checkpoint, server = served
    from transformers import LlamaForCausalLM

    model = GrpcLanguageModel(server.address)
    size = model.context_length - 1
    tokens = [5 + (i * 7) % 300 for i in range(size + 40)]  # two windows
    logprob, count = model.rolling_loglikelihood(tokens, prefix_id=2)
    hf = LlamaForCausalLM.from_pretrained(checkpoint).eval()
    expected = 0.0
    for start, before in ((0, 2), (size, tokens[size - 1])):
        window = tokens[start : start + size]
        with torch.no_grad():
            logits = hf(torch.tensor([[before, *window]])).logits[0].log_softmax(-1)
        expected += sum(float(logits[i, t]) for i, t in enumerate(window))
    assert count == len(tokens)
    assert logprob == pytest.approx(expected, abs=1e-3)
    model.close()


def test_humaneval_pass_at_k_from_sampled_completions(served, tmp_path):
    from services.evaluator.sandbox.runner import run_program
    from services.evaluator.scoring.metrics import pass_at_k
    from services.evaluator.tasks import get_task

    _, server = served
    model = GrpcLanguageModel(server.address, batch_size=4)
    config = EvalConfig(
        tasks=("humaneval",), task_data_path=FIXTURES, output_path=tmp_path,
        max_new_tokens=12, num_samples=4, temperature=1.0, allow_unsafe_code_execution=UNSAFE_OK,
    )  # fmt: skip
    (outcome,) = evaluate(config, model)
    assert set(outcome.scores) == {"pass@1,create_test", "pass@4,create_test"}
    task = get_task("humaneval")
    per_doc = []
    for sample in outcome.samples:
        completions = sample["resps"]
        assert len(completions) == 4
        assert len({json.dumps(a, sort_keys=True) for a in sample["arguments"]}) == 4  # seeds
        passed = sum(
            run_program(task.program(sample["doc"], c), allow_unsafe=UNSAFE_OK).passed
            for c in completions
        )
        per_doc.append(passed)
        assert sample["metrics"]["pass@1,create_test"] == pytest.approx(passed / 4)
        assert sample["metrics"]["pass@4,create_test"] == pass_at_k(4, passed, 4)
    model.close()
