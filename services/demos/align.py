"""`make align`: SFT -> reward model -> GRPO -> convert -> serve -> evaluate, on a tiny model.

    python -m services.demos.align --run-dir runs/make-align

Every stage runs as its own `meshline` command (`python -m services.cli ...`, the console
script's module), so what this exercises is the user-facing CLI. No downloads: the data, the
tokenizer and the model are made here, deterministically.

The task, in GSM8K's format so the evaluator's own `gsm8k` task scores it: "Question: Repeat
the number N.\\nAnswer:" with the reference " #### N" (N in 0..--numbers-1).

1. Writes the instruction set (alpaca records), the preference set (the right answer chosen, a
   a reply in another format rejected), the RL prompts (`prompt`/`answer`) and GSM8K-format eval files, and
   trains a byte-level BPE tokenizer on them (`tokenizers`, saved as a transformers directory).
2. `meshline preprocess` (instruction handler, plain template; pairwise handler).
3. `meshline train --stage sft` (a few iterations), `--stage rm` (from the registry
   initialisation: starting a reward model from SFT weights is not built), then `--stage grpo`
   from the SFT weights, rewarded by the reward model plus the verifiable `gsm8k` answer match.
4. `meshline convert` of the GRPO policy (and the SFT one) to HF, `meshline serve inference` on
   each export, `meshline evaluate --endpoint ... --tasks gsm8k --num-fewshot 0` against it.
5. Prints the reward mean of the first and last GRPO steps and both policies' exact match.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from services.demos.evaluate import InferenceProcess
from training.loop import METRICS_PREFIX, METRICS_STDOUT_ENV

# Tiny Llama: 2 layers, hidden 64 (about 0.1M parameters with the ~300-token vocabulary).
MODEL_FLAGS = [
    "--model", "tiny-llama", "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "176",
    "--num-attention-heads", "4", "--num-query-groups", "2", "--max-position-embeddings", "64",
    "--seq-length", "32",
]  # fmt: skip
VOCAB_SIZE = 320
MAX_NUMBERS = 1000


def question(n: int) -> str:
    """The prompt for N (GSM8K's "Question: ...\\nAnswer:" framing)."""
    return f"Question: Repeat the number {n}.\nAnswer:"


def write_data(root: Path, numbers: int) -> dict[str, Path]:
    """The instruction, preference, prompt and eval files under `root` (deterministic)."""
    root.mkdir(parents=True, exist_ok=True)
    sft, pairs, prompts = [], [], []
    for n in range(numbers):
        prompt, answer = question(n), str(n)
        sft.append({"instruction": prompt, "output": f" #### {answer}"})
        # What the reward model can learn from scratch in a few steps: the answer format.
        # (the repeated marker too: a policy rewarded by this model finds that hack otherwise).
        for rejected in (" I do not know.", f" {answer}", f" The answer is {answer}.",
                         f" #### #### {answer}", " #### #### ####"):  # fmt: skip
            pairs.append({"prompt": prompt, "chosen": f" #### {answer}", "rejected": rejected})
        prompts.append({"prompt": prompt, "answer": answer})
    gsm8k = [{"question": f"Repeat the number {n}.", "answer": f"#### {n}"}
             for n in range(numbers)]  # fmt: skip
    files = {
        "sft": root / "sft.jsonl",
        "pairs": root / "pairs.jsonl",
        "prompts": root / "prompts.jsonl",
        "eval": root / "gsm8k" / "test.jsonl",
    }
    (root / "gsm8k").mkdir(exist_ok=True)
    for name, records in (("sft", sft), ("pairs", pairs), ("prompts", prompts), ("eval", gsm8k)):
        files[name].write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    # gsm8k draws its few-shot pool from train.jsonl beside the test file (unused at 0 shots).
    (root / "gsm8k" / "train.jsonl").write_text(files["eval"].read_text(), encoding="utf-8")
    return files


def train_tokenizer(files: dict[str, Path], directory: Path) -> Path:
    """A byte-level BPE tokenizer trained on the task's text, saved for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = []
    for record in map(json.loads, files["pairs"].read_text().splitlines()):
        texts += [record["prompt"] + record["chosen"], record["prompt"] + record["rejected"]]
    rust = Tokenizer(models.BPE())
    rust.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    rust.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    rust.train_from_iterator(texts, trainer)
    PreTrainedTokenizerFast(
        tokenizer_object=rust,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    ).save_pretrained(directory)
    return directory


def meshline(args: Sequence[str], log: Path) -> list[dict]:
    """Run `meshline ARGS` (the console script's module) with its output in `log`; returns the
    metrics records a training run printed. RuntimeError naming the command when it fails."""
    nonce = secrets.token_hex(8)  # frames the trainer's metrics lines (training/loop.py)
    env = {**os.environ, METRICS_STDOUT_ENV: nonce}
    env.setdefault("OMP_NUM_THREADS", "2")
    start = time.perf_counter()
    with log.open("w", encoding="utf-8") as fh:
        done = subprocess.run(
            [sys.executable, "-m", "services.cli", *args],
            stdout=fh,
            stderr=subprocess.STDOUT,
            env=env,
            check=False,
        )
    lines = log.read_text(encoding="utf-8", errors="replace").splitlines()
    if done.returncode != 0:
        tail = "\n".join(lines[-25:])
        raise RuntimeError(f"`meshline {' '.join(args)}` exited with {done.returncode}:\n{tail}")
    print(f"[align] meshline {args[0]} {args[1]} {args[2]} ... ({time.perf_counter() - start:.0f}s, "
          f"log {log})", flush=True)  # fmt: skip
    prefix = f"{METRICS_PREFIX}{nonce} "
    return [json.loads(line[len(prefix) :]) for line in lines if line.startswith(prefix)]


def main(argv: list[str] | None = None) -> int:
    """Run the whole pipeline; 0 on success."""
    parser = argparse.ArgumentParser(
        prog="python -m services.demos.align", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--run-dir", type=Path, default=Path("runs/make-align"))
    parser.add_argument("--numbers", type=int, default=30, help="task size: N in 0..numbers-1")
    parser.add_argument("--sft-iters", type=int, default=40, help="SFT optimizer steps")
    parser.add_argument("--rm-iters", type=int, default=30, help="reward-model optimizer steps")
    parser.add_argument("--grpo-iters", type=int, default=20, help="GRPO optimizer steps")
    args = parser.parse_args(argv)
    for flag in ("numbers", "sft_iters", "rm_iters", "grpo_iters"):
        if getattr(args, flag) < 1:
            parser.error(
                f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}"
            )
    if args.numbers > MAX_NUMBERS:
        parser.error(
            f"--numbers must be at most {MAX_NUMBERS} (the prompts fit --max-prompt-length)"
        )
    started = time.perf_counter()
    run = args.run_dir.resolve()
    logs = run / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    try:
        summary = pipeline(args, run, logs)
    except (RuntimeError, ValueError) as exc:
        print(f"make align: {exc}", file=sys.stderr)
        return 1
    summary["wall_time_s"] = round(time.perf_counter() - started, 1)
    (run / "summary.json").write_text(json.dumps(summary, indent=2))
    print(summary_text(summary, run), flush=True)
    return 0


def pipeline(args: argparse.Namespace, run: Path, logs: Path) -> dict:
    """Stages 1-4; returns the summary record."""
    files = write_data(run / "data", args.numbers)
    tok = train_tokenizer(files, run / "tokenizer")
    print(f"[align] data and tokenizer under {run}", flush=True)
    tok_flags = ["--tokenizer-type", "PretrainedFromHF", "--tokenizer-name-or-path", str(tok)]
    shards = run / "shards"
    meshline(["preprocess", "--input", str(files["sft"]), "--output-prefix", str(shards / "sft"),
              "--handler-name", "GeneralInstructionHandler", "--prompt-template", "plain",
              *tok_flags, "--seq-length", "32", "--overwrite"], logs / "preprocess-sft.log")  # fmt: skip
    meshline(["preprocess", "--input", str(files["pairs"]), "--output-prefix", str(shards / "pairs"),
              "--handler-name", "preference", *tok_flags, "--seq-length", "32", "--overwrite"],
             logs / "preprocess-pairs.log")  # fmt: skip
    common = [*MODEL_FLAGS, *tok_flags, "--lr-decay-style", "constant", "--log-interval", "1",
              "--eval-interval", "0", "--seed", "1234", "--spike-factor", "0"]  # fmt: skip
    sft = run / "sft"
    meshline(["train", "--stage", "sft", *common, "--data-path", str(shards / "sft"),
              "--is-instruction-dataset", "--split", "100,0,0", "--micro-batch-size", "8",
              "--global-batch-size", "8", "--lr", "3e-3", "--train-iters", str(args.sft_iters),
              "--save", str(sft), "--log-dir", str(logs / "sft")], logs / "train-sft.log")  # fmt: skip
    rm = run / "rm"
    rm_metrics = meshline(["train", "--stage", "rm", *common, "--data-path", str(shards / "pairs"),
              "--split", "100,0,0", "--micro-batch-size", "8", "--global-batch-size", "8",
              "--lr", "3e-3", "--train-iters", str(args.rm_iters), "--save", str(rm),
              "--log-dir", str(logs / "rm")], logs / "train-rm.log")  # fmt: skip
    grpo = run / "grpo"
    grpo_metrics = meshline(["train", "--stage", "grpo", *common, "--load", str(sft), "--finetune",
              "--data-path", str(files["prompts"]), "--max-prompt-length", "20",
              "--max-completion-length", "6", "--num-generations", "8", "--micro-batch-size", "4",
              "--global-batch-size", "8", "--lr", "1e-3", "--temperature", "1.0",
              "--reward-funcs", "reward_model", "gsm8k", "--reward-weights", "0.25", "1",
              "--reward-model", str(rm), "--beta", "0.04",
              "--train-iters", str(args.grpo_iters), "--save", str(grpo),
              "--log-dir", str(logs / "grpo")], logs / "train-grpo.log")  # fmt: skip
    scores = {}
    for name, checkpoint in (("sft", sft), ("grpo", grpo)):
        hf = run / f"hf-{name}"
        meshline(["convert", "--load-format", "native", "--save-format", "hf", "--load-dir",
                  str(checkpoint), "--save-dir", str(hf)], logs / f"convert-{name}.log")  # fmt: skip
        scores[name] = serve_and_evaluate(hf, files["eval"].parent, run / f"eval-{name}", logs)
    return {
        "rm": step_record(rm_metrics[-1]),
        "grpo_first": step_record(grpo_metrics[0]),
        "grpo_last": step_record(grpo_metrics[-1]),
        # Sampled at temperature 1, one step's reward is noisy: the first and last quarters.
        "reward_start": quarter_mean(grpo_metrics[: max(1, len(grpo_metrics) // 4)]),
        "reward_end": quarter_mean(grpo_metrics[-max(1, len(grpo_metrics) // 4) :]),
        "exact_match": scores,
    }


def quarter_mean(records: list[dict]) -> dict:
    """The mean GRPO reward over `records` and their first and last step."""
    rewards = [r["objective"]["reward"] for r in records]
    steps = (records[0]["step"], records[-1]["step"])
    return {"reward": sum(rewards) / len(rewards), "steps": steps}


def step_record(record: dict) -> dict:
    """A trainer metrics record's step, loss and objective quantities, flat."""
    return {"step": record["step"], "loss": record["loss"], **record.get("objective", {})}


def serve_and_evaluate(hf: Path, task_data: Path, output: Path, logs: Path) -> float:
    """`meshline serve inference` on the HF export, `meshline evaluate` through it; gsm8k's
    strict-match exact match."""
    server = InferenceProcess(hf, load_format="hf")
    try:
        meshline(["evaluate", "--endpoint", server.address, "--tasks", "gsm8k",
                  "--task-data-path", str(task_data), "--num-fewshot", "0",
                  "--max-new-tokens", "8", "--output-path", str(output), "--no-progress"],
                 logs / f"evaluate-{hf.name}.log")  # fmt: skip
    finally:
        server.stop()
    results = sorted(output.rglob("results*.json"))
    if not results:
        raise RuntimeError(f"meshline evaluate wrote no results under {output}")
    document = json.loads(results[-1].read_text())
    return float(document["results"]["gsm8k"]["exact_match,strict-match"])


def summary_text(summary: dict, run: Path) -> str:
    """The closing summary of `make align`."""
    rm, first, last = summary["rm"], summary["grpo_first"], summary["grpo_last"]
    start, end = summary["reward_start"], summary["reward_end"]
    scores = summary["exact_match"]
    return "\n".join(
        [
            "",
            "make align: done",
            f"  reward model    pair accuracy {rm['accuracy']:.2f}, loss {rm['loss']:.3f} "
            f"(step {rm['step']})",
            f"  GRPO reward     {first['reward']:.3f} (step {first['step']}) -> "
            f"{last['reward']:.3f} (step {last['step']}); steps {start['steps'][0]}-"
            f"{start['steps'][1]} {start['reward']:.3f} -> steps {end['steps'][0]}-"
            f"{end['steps'][1]} {end['reward']:.3f} (mean over the sampled completions of "
            "0.25 x the reward model's score + the gsm8k answer match)",
            f"  gsm8k exact     {scores['sft']:.2f} (SFT policy) -> {scores['grpo']:.2f} (GRPO "
            "policy), strict-match, greedy, served HF exports",
            f"  outputs         {run} (summary.json, logs/)",
            f"  wall time       {summary['wall_time_s']:.0f}s",
        ]
    )


if __name__ == "__main__":
    sys.exit(main())
