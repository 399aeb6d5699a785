"""Multiple-choice scoring: Meshline's evaluator vs lm-evaluation-harness's HFLM, same run.

    python -m bench.bench_evaluator [--quick] [--threads 2] [--rounds 3]

Both sides score the same log-likelihood requests (MMLU-format 5-shot prompts built from the
fixture subset, 4 choices each, repeated to `--docs` documents) on the same random HF Llama and
sentencepiece tokenizer, batch size 8, fp32, CPU:

- ours-grpc: `GrpcLanguageModel` -> a real InferenceService on localhost (`Score` calls);
- ours-local: `LocalLanguageModel` (the inference engine's batched scoring in-process);
- lm-eval: `lm_eval.models.huggingface.HFLM.loglikelihood` over the same HF model.

The context length is large enough that neither side truncates, so log-likelihoods must agree
(the max abs difference is printed). Rounds alternate the three and report medians;
ratio = lm-eval time / our time (> 1: ours is faster).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from models.tokenizer import train_sentencepiece
from services.evaluator.models.grpc_client import GrpcLanguageModel
from services.evaluator.models.local import LocalLanguageModel
from services.evaluator.runner import EvalConfig, prepare_task
from services.evaluator.tasks import get_task
from services.inference.config import InferenceServiceConfig
from services.inference.servicer import bindings, load_engine

FIXTURES = Path(__file__).parents[1] / "tests" / "fixtures" / "evaluator"


def build_checkpoint(directory: Path, hidden: int, layers: int, context: int) -> Path:
    """A random HF Llama + a sentencepiece tokenizer trained on the fixtures."""
    from transformers import LlamaConfig, LlamaForCausalLM

    corpus = directory / "corpus.txt"
    texts = [p.read_text(encoding="utf-8") for p in sorted(FIXTURES.rglob("*")) if p.is_file()]
    corpus.write_text("\n".join(texts) * 3, encoding="utf-8")
    sp_model = train_sentencepiece([corpus], directory / "sp", 512)
    config = LlamaConfig(
        vocab_size=512, hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 128),
        max_position_embeddings=context, bos_token_id=1, eos_token_id=2, pad_token_id=3,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = LlamaForCausalLM._from_config(config, attn_implementation="sdpa").eval()
    out = directory / "ckpt"
    hf.save_pretrained(out)
    (out / "tokenizer.model").write_bytes(sp_model.read_bytes())
    return out


def requests(num_docs: int) -> list[tuple[str, str]]:
    """(context, continuation) pairs of 5-shot MMLU prompts, cycled to `num_docs` documents."""
    pairs = []
    for name in ("mmlu_anatomy", "mmlu_astronomy"):
        config = EvalConfig(tasks=(name,), task_data_path=FIXTURES, output_path=FIXTURES)
        prepared = prepare_task(get_task(name), config)
        pairs.extend([(a[0], a[1]) for _, a in doc] for doc in prepared.requests)
    out: list[tuple[str, str]] = []
    for i in range(num_docs):
        out.extend(pairs[i % len(pairs)])
    return out


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small model, few documents")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--docs", type=int, default=None, help="documents (x4 requests)")
    return parser.parse_args(argv)


def _lm_eval_baseline(checkpoint: Path, context: int) -> Any:
    """lm-evaluation-harness's HFLM over the checkpoint's HF model and tokenizer."""
    from lm_eval.models.huggingface import HFLM
    from transformers import LlamaForCausalLM, LlamaTokenizer

    tokenizer = LlamaTokenizer.from_pretrained(str(checkpoint), legacy=False, add_bos_token=True)
    hf = LlamaForCausalLM.from_pretrained(checkpoint).eval()
    return HFLM(
        pretrained=hf, tokenizer=tokenizer, batch_size=8, max_length=context, add_bos_token=True
    )


def _score_rounds(
    runs: dict[str, Callable[[], list[float]]], rounds: int
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Seconds of each run per round (alternating them) and each run's last log-likelihoods."""
    times: dict[str, list[float]] = {k: [] for k in runs}
    values: dict[str, list[float]] = {}
    for _ in range(rounds):
        for name, fn in runs.items():
            start = time.perf_counter()
            values[name] = fn()
            times[name].append(time.perf_counter() - start)
    return times, values


def _measure(
    checkpoint: Path, pairs: list[tuple[str, str]], context: int, rounds: int
) -> tuple[dict[str, list[float]], dict[str, list[float]], int]:
    """Time the three scorers on `pairs`: (seconds per round, log-likelihoods, longest request
    in tokens)."""
    from lm_eval.api.instance import Instance

    from tests.services.evaluator.servers import ServerThread

    service_config = InferenceServiceConfig(load=checkpoint, load_format="hf")
    server = ServerThread(bindings(service_config, load_engine(service_config)))
    remote = GrpcLanguageModel(server.address, batch_size=8)
    local = LocalLanguageModel(checkpoint, load_format="hf", batch_size=8)
    baseline = _lm_eval_baseline(checkpoint, context)
    instances = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    longest = max(len(remote.tokenize([c + x])[0]) for c, x in pairs)
    runs = {
        "ours-grpc": lambda: [lp for lp, _ in remote.loglikelihood(pairs)],
        "ours-local": lambda: [lp for lp, _ in local.loglikelihood(pairs)],
        "lm-eval": lambda: [lp for lp, _ in baseline.loglikelihood(instances, disable_tqdm=True)],
    }
    times, values = _score_rounds(runs, rounds)
    server.stop()
    return times, values, longest


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print one table."""
    args = _parse_args(argv)
    torch.set_num_threads(args.threads)
    hidden, layers, docs = (128, 2, 10) if args.quick else (256, 4, 40)
    docs = args.docs or docs
    context = 2048
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = build_checkpoint(Path(tmp), hidden, layers, context)
        pairs = requests(docs)
        times, values, longest = _measure(checkpoint, pairs, context, args.rounds)
    med = {k: statistics.median(v) for k, v in times.items()}
    diff = max(
        abs(a - b)
        for name in ("ours-grpc", "ours-local")
        for a, b in zip(values[name], values["lm-eval"], strict=True)
    )
    print(
        json.dumps(
            {
                "config": dict(
                    hidden=hidden,
                    layers=layers,
                    vocab=512,
                    docs=docs,
                    requests=len(pairs),
                    longest_tokens=longest,
                    batch_size=8,
                    threads=args.threads,
                    rounds=args.rounds,
                    dtype="fp32",
                ),
                "max_abs_loglikelihood_diff_vs_lm_eval": diff,
            }
        )
    )
    print(f"{'path':<12}{'median s':>10}{'req/s':>10}{'ratio':>8}")
    for name, seconds in med.items():
        ratio = med["lm-eval"] / seconds
        print(f"{name:<12}{seconds:>10.2f}{len(pairs) / seconds:>10.1f}{ratio:>8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
