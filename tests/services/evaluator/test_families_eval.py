"""The evaluator on issue #18's families: Llama-3 (llama3 RoPE, tied head), Qwen2 (qkv bias),
Qwen3 (q/k norm, explicit head_dim), Mistral (sliding window 8, served from a ring cache of 8
slots), Mixtral, Qwen2-MoE (gated shared expert) and Qwen3-MoE.

For each, transformers' own class writes a random checkpoint with `save_pretrained` (plus the
fixture-trained sentencepiece `tokenizer.model`); the user's two ways in are run: `meshline eval
--load DIR --load-format hf` on that directory and, after `meshline convert` (HF → native,
verified), `--load-format native` on the conversion. The evaluator's runner drives the
in-process engine over fixture subsets of BoolQ and MMLU (log-likelihood; contexts of 80-750
tokens, far past the window and the llama3 original context of 16) and GSM8K (greedy
generation, 5-shot prompts of 550-630 tokens). The reference is transformers' model itself:
lm-evaluation-harness's own `HFLM` around it must give the same per-choice log-likelihoods and
is-greedy flags, and HF `generate` the same greedy answers.
"""

from __future__ import annotations

import json
import shutil

import pytest

from services.converter.job import ConvertOptions, convert
from services.evaluator.models.local import LocalLanguageModel
from services.evaluator.results import write_results
from services.evaluator.runner import EvalConfig, evaluate
from tests.models.test_families import FAMILIES, hf_model
from tests.services.evaluator.lm_eval_ref import FIXTURES
from tests.services.evaluator.servers import train_fixture_tokenizer
from tests.services.inference.helpers import hf_generate

CONTEXT = 1024
"""max_position_embeddings: BoolQ/MMLU prompts fit, so neither side truncates a log-likelihood
request (lm-eval and Meshline cut an over-long one at different lengths)."""
LOGLIKELIHOOD_TASKS = ("boolq", "mmlu_anatomy")
GENERATION_TASK = "gsm8k"
MAX_NEW_TOKENS = 16


@pytest.fixture(scope="module")
def tokenizer_model(tmp_path_factory):
    return train_fixture_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(
    scope="module",
    params=["llama3", "qwen2", "qwen3", "mistral", "mixtral", "qwen2_moe", "qwen3_moe"],
)
def family(request, tmp_path_factory, tokenizer_model):
    """(family, HF model, its save_pretrained directory with tokenizer.model)."""
    import sentencepiece

    vocab = sentencepiece.SentencePieceProcessor(model_file=str(tokenizer_model)).vocab_size()
    hf = hf_model(
        FAMILIES[request.param], seed=3, vocab_size=vocab, max_position_embeddings=CONTEXT
    )
    for holder in (hf.config, hf.generation_config):
        holder.bos_token_id, holder.eos_token_id, holder.pad_token_id = 1, 2, 3
    directory = tmp_path_factory.mktemp("hf") / request.param
    hf.save_pretrained(directory)
    shutil.copy2(tokenizer_model, directory / "tokenizer.model")
    return request.param, hf, directory


def _reference(hf, directory):
    """lm-eval's HFLM over the transformers model, tokenising as Llama tokenizers do (BOS)."""
    from lm_eval.models.huggingface import HFLM
    from transformers import LlamaTokenizer

    tokenizer = LlamaTokenizer.from_pretrained(str(directory), legacy=False, add_bos_token=True)
    return HFLM(
        pretrained=hf, tokenizer=tokenizer, batch_size=1, max_length=CONTEXT, add_bos_token=True
    )


def _samples(output, task):
    path = output / f"samples_{task}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def _run(model, tasks, output):
    config = EvalConfig(
        tasks=tasks, task_data_path=FIXTURES, output_path=output, limit=3,
        max_new_tokens=MAX_NEW_TOKENS, batch_size=4,
    )  # fmt: skip
    outcomes = evaluate(config, model)
    write_results(output, outcomes, {"model": model.name}, 0.0)
    return outcomes


def _check_loglikelihoods(reference, output):
    from lm_eval.api.instance import Instance

    compared = 0
    for task in LOGLIKELIHOOD_TASKS:
        samples = _samples(output, task)
        pairs = [tuple(args) for sample in samples for args in sample["arguments"]]
        ours = [tuple(r) for sample in samples for r in sample["resps"]]
        theirs = reference.loglikelihood(
            [Instance("loglikelihood", {}, p, i) for i, p in enumerate(pairs)], disable_tqdm=True
        )
        for (lp, greedy), (ref_lp, ref_greedy) in zip(ours, theirs, strict=True):
            assert lp == pytest.approx(ref_lp, abs=1e-3) and greedy == ref_greedy, task
        compared += len(pairs)
    return compared


def test_evaluator_equals_lm_eval_hflm_on_the_transformers_model(family, tmp_path):
    name, hf, directory = family
    model = LocalLanguageModel(directory, load_format="hf", batch_size=4)
    assert model.context_length == CONTEXT
    outcomes = _run(model, (*LOGLIKELIHOOD_TASKS, GENERATION_TASK), tmp_path)
    longest = max(
        len(model.tokenize([a[0]])[0]) for s in _samples(tmp_path, "mmlu_anatomy")
        for a in s["arguments"]
    )  # fmt: skip
    model.close()
    assert longest > 8 * 10, longest  # far past the window and llama3's original context
    assert {o.task.name for o in outcomes} >= {*LOGLIKELIHOOD_TASKS, GENERATION_TASK}
    reference = _reference(hf, directory)

    # Log-likelihood tasks: every choice of every sample.
    assert _check_loglikelihoods(reference, tmp_path) >= 3 * 2 + 3 * 4

    # Greedy generation: HF `generate` on the prompt as HF's tokenizer encodes it (cut from the
    # left to leave room for the answer, as lm-eval does), decoded by the checkpoint's
    # sentencepiece model and cut at the first stop string. (HFLM's own text is not the
    # reference here: transformers' converted tokenizer decodes a lone byte-fallback token
    # such as <0x1F> as U+FFFD where sentencepiece gives the byte.)
    import sentencepiece

    pieces = sentencepiece.SentencePieceProcessor(model_file=str(directory / "tokenizer.model"))
    samples = _samples(tmp_path, GENERATION_TASK)
    for sample in samples:
        context, kwargs = sample["arguments"][0]
        ids = reference.tokenizer(context).input_ids[-(CONTEXT - MAX_NEW_TOKENS) :]
        out = hf_generate(hf, ids, max_new_tokens=MAX_NEW_TOKENS, eos_token_id=2)
        text = pieces.decode([t for t in out[0, len(ids) :].tolist() if t != 2])
        for stop in kwargs["until"]:
            text = text.split(stop)[0]
        assert sample["resps"][0] == text, name
    assert any(s["resps"][0].strip() for s in samples)  # something was generated


def test_converted_native_checkpoint_evaluates_the_same(family, tmp_path):
    """`meshline convert` HF → native (verified by default), then `--load-format native`."""
    _, hf, directory = family
    report = convert(ConvertOptions("hf", "native", directory, tmp_path / "native"))
    assert report.verify is not None
    model = LocalLanguageModel(tmp_path / "native", load_format="native", batch_size=4)
    _run(model, LOGLIKELIHOOD_TASKS, tmp_path / "out")
    model.close()
    assert _check_loglikelihoods(_reference(hf, directory), tmp_path / "out") >= 3 * 2 + 3 * 4
