"""`make eval`: the `make train` checkpoint through a local inference service, on fixture subsets.

    python -m services.demos.evaluate --run-dir runs/make-train

1. Starts `meshline serve inference --load {run-dir}/checkpoints` (native format) on a free
   localhost port, as its own process, and waits for it to listen.
2. Evaluates every benchmark's bundled fixture subset (`tests/fixtures/evaluator`, the published
   file formats) through it with the gRPC client: BoolQ, MMLU, C-Eval, AGIEval by log-likelihood,
   GSM8K (CoT), BBH and HumanEval (sandboxed) by generation.
3. Measures perplexity on the validation documents of the training shards (the trainer's
   `--split 98,2,0`) through Score, beside the trainer's own validation loss.
4. Prints the harness-style table and writes results under `{run-dir}/eval`.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from services.evaluator.models.grpc_client import GrpcLanguageModel
from services.evaluator.results import atomic_write, format_table, write_results
from services.evaluator.runner import EvalConfig, evaluate
from services.evaluator.sandbox.runner import UNSAFE_FLAG, isolation

FIXTURES = Path(__file__).parents[2] / "tests" / "fixtures" / "evaluator"
TASKS = ("boolq", "mmlu", "ceval-valid", "agieval", "gsm8k", "gsm8k_cot", "bbh", "humaneval")
SHARD = Path("stdlib") / "shards" / "stdlib_text_document"
TRAIN_SPLIT = "98,2,0"
_LISTENING = re.compile(r"serving .* on (?P<address>[\w.\-\[\]:]+:\d+)")


class InferenceProcess:
    """`meshline serve inference` on a free port, stopped with SIGTERM."""

    def __init__(
        self, checkpoint: Path, timeout_s: float = 600.0, load_format: str = "native"
    ) -> None:
        # `meshline serve inference` (the console script's module), as a user starts it.
        self.process = subprocess.Popen(
            [
                sys.executable, "-m", "services.cli", "serve", "inference", "--host",
                "127.0.0.1", "--port", "0", "--load", str(checkpoint), "--load-format", load_format,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        self.lines: list[str] = []
        self._address: str | None = None
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        if not self._ready.wait(timeout_s) or self._address is None:
            self.stop()
            raise RuntimeError("the inference service did not start:\n" + "".join(self.lines[-20:]))

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line)
            match = _LISTENING.search(line)
            if match and self._address is None:
                self._address = match["address"]
                self._ready.set()
        self._ready.set()

    @property
    def address(self) -> str:
        """host:port it listens on."""
        assert self._address is not None
        return self._address

    def stop(self) -> None:
        """SIGTERM, then wait (kill after 30 s)."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def validation_perplexity(
    model: GrpcLanguageModel, shard_prefix: Path, max_tokens: int
) -> tuple[float, int, int]:
    """(perplexity, tokens, documents) over the validation split's first `max_tokens` tokens."""
    # imported here: these load torch, which the rest of `make eval`'s client never needs
    from tokendata.datasets.config import parse_split, split_document_range
    from tokendata.indexed import IndexedDataset

    data = IndexedDataset(str(shard_prefix))
    bounds = parse_split(TRAIN_SPLIT)[1]
    assert bounds is not None
    begin, end = split_document_range(bounds, data.num_documents)
    prefix = model.info.eos_token_id if model.info.HasField("eos_token_id") else 0
    total_lp, total_tokens, docs = 0.0, 0, 0
    for doc in range(begin, end):
        tokens = [int(t) for t in data.document(doc)][: max_tokens - total_tokens]
        if not tokens:
            break
        lp, n = model.rolling_loglikelihood(tokens, prefix)
        total_lp, total_tokens, docs = total_lp + lp, total_tokens + n, docs + 1
        if total_tokens >= max_tokens:
            break
    if not total_tokens:
        raise ValueError(f"{shard_prefix}: the validation split ({TRAIN_SPLIT}) has no tokens")
    return math.exp(-total_lp / total_tokens), total_tokens, docs


def build_parser() -> argparse.ArgumentParser:
    """The demo's flags."""
    parser = argparse.ArgumentParser(
        prog="python -m services.demos.evaluate", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--run-dir", type=Path, default=Path("runs/make-train"))
    parser.add_argument("--data-dir", type=Path, default=Path("data"), help="make train's data")
    parser.add_argument("--task-data-path", type=Path, default=FIXTURES)
    parser.add_argument("--limit", type=int, default=None, help="samples per task at most")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="generation cap")
    parser.add_argument("--ppl-tokens", type=int, default=16384, help="validation tokens scored")
    parser.add_argument(
        UNSAFE_FLAG,
        dest="allow_unsafe_code_execution",
        action="store_true",
        help="run HumanEval even where this host cannot sandbox generated code (docs/security.md)",
    )
    return parser


def runnable_tasks(allow_unsafe_code_execution: bool) -> tuple[str, ...]:
    """TASKS, less humaneval where generated code could not be sandboxed (and not allowed)."""
    if isolation().available or allow_unsafe_code_execution:
        return TASKS
    print(
        f"[eval] humaneval left out: this host cannot sandbox generated code "
        f"({isolation().reason}); pass {UNSAFE_FLAG} to run it anyway",
        flush=True,
    )
    return tuple(t for t in TASKS if t != "humaneval")


def _evaluate_served(
    args: argparse.Namespace, address: str, checkpoint: Path, tasks: tuple[str, ...], start: float
) -> tuple[Path, dict[str, Any], str]:
    """The tasks and the validation perplexity through the service at `address`: the results
    file, its document and the perplexity line to print."""
    output = args.run_dir / "eval"
    model = GrpcLanguageModel(address, batch_size=8)
    config = EvalConfig(
        tasks=tasks,
        task_data_path=args.task_data_path,
        output_path=output,
        limit=args.limit,
        max_new_tokens=args.max_new_tokens,
        allow_unsafe_code_execution=args.allow_unsafe_code_execution,
    )
    outcomes = evaluate(config, model)
    settings = {
        "model": "meshline-grpc",
        "model_args": f"{address} ({checkpoint})",
        "batch_size": config.batch_size,
        "limit": config.limit,
        "random_seed": config.seed,
        "fewshot_seed": config.seed,
    }
    path, document = write_results(output, outcomes, settings, start)
    shard = args.data_dir / SHARD
    ppl_line = f"  validation perplexity: skipped ({shard}.bin not found)"
    if shard.with_suffix(".bin").is_file():
        ppl, tokens, docs = validation_perplexity(model, shard, args.ppl_tokens)
        ppl_line = (
            f"  validation perplexity: {ppl:.2f} over {tokens:,} tokens of {docs} held-out "
            f"documents (split {TRAIN_SPLIT}, windows of {model.context_length})"
        )
        document["validation_perplexity"] = {"value": ppl, "tokens": tokens, "documents": docs}
        atomic_write(path, json.dumps(document, ensure_ascii=False, indent=2, default=str))
    model.close()
    return path, document, ppl_line


def _print_summary(run_dir: Path, path: Path, ppl_line: str, start: float) -> None:
    print("\nmake eval: done")
    print(ppl_line)
    summary = run_dir / "logs" / "summary.json"
    if summary.is_file():
        val_loss = json.loads(summary.read_text()).get("val_loss")
        if val_loss is not None:
            print(f"  trainer validation loss {val_loss:.3f} (perplexity {math.exp(val_loss):.2f})")
    print(f"  results {path} (samples beside it)")
    print(f"  wall time {time.time() - start:.0f}s")


def main(argv: list[str] | None = None) -> int:
    """Run the demo; 0 on success, 2 when something it needs is missing."""
    args = build_parser().parse_args(argv)
    tasks = runnable_tasks(args.allow_unsafe_code_execution)
    checkpoint = args.run_dir / "checkpoints"
    if not (checkpoint / "latest").is_file():
        print(
            f"make eval: no checkpoint at {checkpoint} (no `latest` file); run `make train` "
            "first (or pass --run-dir of a finished run)",
            file=sys.stderr,
        )
        return 2
    start = time.time()
    print(f"[eval] starting the inference service on {checkpoint}", flush=True)
    try:
        server = InferenceProcess(checkpoint)
    except RuntimeError as exc:
        print(f"make eval: {exc}", file=sys.stderr)
        return 2
    try:
        print(f"[eval] inference service on {server.address}", flush=True)
        path, document, ppl_line = _evaluate_served(args, server.address, checkpoint, tasks, start)
    finally:
        server.stop()
    print(format_table(document))
    _print_summary(args.run_dir, path, ppl_line, start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
