"""ModelLink's README commands, sizes made tiny, run with only the entry point renamed.

`tools/preprocess_data.py` -> `meshline preprocess`, `pretrain_llama.py` -> `meshline train`,
`tools/ckpt_convert/...` and the LoRA merge script -> `meshline convert`, the generation and
`evaluation_llama.py` scripts -> `meshline generate` / `meshline evaluate`. Each test checks what
the command produced: shards, a resumed step count, a peft-layout adapter, a merged Megatron
checkpoint, generated ids, a results JSON. Fixtures (tokenizer, corpus) are built here.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from safetensors import safe_open

from services import cli as meshline
from tests.fixtures.tokenizers import CORPUS

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "evaluator"

# ModelLink's Llama-7B pretraining script's flags, with tiny sizes (pretrain_llama_7B_*.sh).
LLAMA_MODEL = [
    "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128",
    "--num-attention-heads", "4", "--seq-length", "32", "--max-position-embeddings", "32",
    "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--norm-epsilon", "1e-6",
    "--swiglu", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
    "--make-vocab-size-divisible-by", "1",
]  # fmt: skip
LLAMA_RUN = [
    "--micro-batch-size", "2", "--global-batch-size", "2", "--lr", "1e-3",
    "--lr-decay-style", "cosine", "--min-lr", "1e-5", "--weight-decay", "1e-2",
    "--clip-grad", "1.0", "--lr-warmup-fraction", ".01", "--split", "949,50,1",
    "--data-impl", "mmap", "--distributed-backend", "nccl", "--DDP-impl", "local",
    "--checkpoint-activations", "--use-flash-attn", "--use-fused-rmsnorm", "--triangle-attn",
    "--mlp-layer-fusion", "--no-masked-softmax-fusion", "--attention-softmax-in-fp32",
    "--no-gradient-accumulation-fusion", "--log-interval", "1", "--eval-interval", "100",
    "--eval-iters", "1", "--seed", "42",
]  # fmt: skip


def _tokenizer_flags(tok: Path) -> list[str]:
    return ["--tokenizer-type", "PretrainedFromHF", "--tokenizer-name-or-path", str(tok),
            "--tokenizer-not-use-fast"]  # fmt: skip


@pytest.fixture(scope="module")
def work(tmp_path_factory, hf_tokenizer_dir):
    """Tokenizer dir, a pretraining parquet and an alpaca-style parquet (what the README feeds)."""
    root = tmp_path_factory.mktemp("modellink")
    lines = [ln for ln in CORPUS.read_text(encoding="utf-8").splitlines() if ln.strip()]
    docs = [" ".join(lines[i : i + 4]) for i in range(0, len(lines), 4)] * 4
    pq.write_table(pa.table({"text": docs}), root / "train-00000-of-00001.parquet")
    alpaca = {
        "instruction": [f"Repeat line {i}." for i in range(24)],
        "input": ["" if i % 2 else lines[i % len(lines)] for i in range(24)],
        "output": [lines[(i + 1) % len(lines)] for i in range(24)],
    }
    pq.write_table(pa.table(alpaca), root / "alpaca.parquet")
    return {"root": root, "tok": Path(hf_tokenizer_dir)}


def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    code = meshline.main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="module")
def shards(work):
    """`python tools/preprocess_data.py` (pretraining, README's wikipedia/alpaca-text form)."""
    root = work["root"]
    code = meshline.main([
        "preprocess", "--input", str(root / "train-00000-of-00001.parquet"),
        "--output-prefix", str(root / "data" / "alpaca"), "--dataset-impl", "mmap",
        *_tokenizer_flags(work["tok"]), "--json-key", "text", "--workers", "1",
    ])  # fmt: skip
    assert code == 0
    return root / "data" / "alpaca_text_document"


def test_preprocess_pretraining_and_instruction_data(work, shards, capsys):
    assert shards.with_suffix(".bin").stat().st_size > 0 and shards.with_suffix(".idx").is_file()
    root = work["root"]
    code, _, err = _run([
        "preprocess", "--input", str(root / "alpaca.parquet"),
        "--output-prefix", str(root / "sft" / "alpaca"), *_tokenizer_flags(work["tok"]),
        "--handler-name", "GeneralInstructionHandler", "--append-eod", "--workers", "1",
    ], capsys)  # fmt: skip
    assert code == 0, err
    made = sorted(p.name for p in (root / "sft").iterdir())
    assert len([n for n in made if n.endswith(".bin")]) == 3, made  # README: 3 bin + 3 idx
    assert len([n for n in made if n.endswith(".idx")]) == 3, made


@pytest.fixture(scope="module")
def pretrained(work, shards):
    """`pretrain_llama.py` with `--load X --save X` on a fresh directory, then resumed."""
    ckpt = work["root"] / "ckpt"
    base = ["train", *LLAMA_MODEL, *LLAMA_RUN, "--data-path", str(shards),
            *_tokenizer_flags(work["tok"]), "--save", str(ckpt), "--load", str(ckpt)]  # fmt: skip
    first = meshline.main([*base, "--train-iters", "3", "--lr-decay-iters", "3"])
    assert first == 0
    assert (ckpt / "latest").read_text().strip() == "3"
    return base, ckpt


def test_load_and_save_the_same_fresh_directory_starts_then_resumes(pretrained, capsys):
    base, ckpt = pretrained
    code, out, err = _run([*base, "--train-iters", "5", "--lr-decay-iters", "5"], capsys)
    assert code == 0, err
    assert "starting from step 0" not in err
    assert "step 4/5" in out and "step 5/5" in out and "step 1/5" not in out, out
    assert (ckpt / "latest").read_text().strip() == "5"
    summary_steps = [ln for ln in out.splitlines() if ln.strip().startswith("steps")]
    assert summary_steps and summary_steps[0].split()[-1] == "5", out  # step count carried on


@pytest.fixture(scope="module")
def lora_run(work, pretrained):
    """README's LoRA flags: ModelLink target names, modules to save, forward hook."""
    _, ckpt = pretrained
    out = work["root"] / "lora"
    code = meshline.main([
        "train", *LLAMA_MODEL, *LLAMA_RUN, "--data-path", str(work["root"] / "data" /
        "alpaca_text_document"), *_tokenizer_flags(work["tok"]), "--load", str(ckpt),
        "--finetune", "--no-load-optim", "--no-load-rng", "--save", str(out),
        "--train-iters", "2", "--lr-decay-iters", "2",
        "--lora-target-modules", "query_key_value", "dense", "gate_proj", "dense_h_to_4h",
        "dense_4h_to_h", "--lora-r", "8", "--lora-alpha", "16",
        "--lora-modules-to-save", "word_embeddings", "output_layer",
        "--lora-register-forward-hook", "word_embeddings", "input_layernorm",
    ])  # fmt: skip
    assert code == 0
    return out / "adapter"


def test_lora_finetune_exports_a_peft_adapter(lora_run):
    config = json.loads((lora_run / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 8 and config["lora_alpha"] == 16
    targets = set(config["target_modules"])
    assert {"q_proj", "k_proj", "v_proj", "o_proj", "down_proj"} <= targets, targets
    assert {"gate_proj", "up_proj"} <= targets, targets
    assert set(config["modules_to_save"]) == {"embed_tokens", "lm_head"}
    with safe_open(str(lora_run / "adapter_model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert all(k.startswith("base_model.model.") for k in keys)
    assert any("self_attn.q_proj.lora_A" in k for k in keys)
    assert any("mlp.gate_proj.lora_B" in k for k in keys)
    assert any("embed_tokens" in k for k in keys) and any("lm_head" in k for k in keys)


def test_convert_to_megatron_and_merge_lora_with_modellink_flags(work, pretrained, lora_run,
                                                                 capsys):  # fmt: skip
    _, ckpt = pretrained
    root = work["root"]
    mg = root / "llama-tp1-pp1"
    code, _, err = _run(["convert", "--load-format", "native", "--save-format", "megatron",
                         "--load", str(ckpt), "--save", str(mg)], capsys)  # fmt: skip
    assert code == 0, err
    assert (mg / "latest_checkpointed_iteration.txt").is_file()
    merged = root / "merged"
    # ModelLink's merge: --load BASE --lora-load LORA --save OUT (Megatron in and out, merged).
    code, _, err = _run([
        "convert", "--load", str(mg), "--lora-load", str(lora_run), "--save", str(merged),
        "--lora-r", "8", "--lora-alpha", "16", "--lora-target-modules", "query_key_value",
        "dense", "gate_proj", "dense_h_to_4h", "dense_4h_to_h",
    ], capsys)  # fmt: skip
    assert code == 0, err
    assert (merged / "latest_checkpointed_iteration.txt").is_file()
    assert list(merged.rglob("model_optim_rng.pt"))


def test_generate_with_modellink_flags(work, pretrained, capsys):
    _, ckpt = pretrained
    out = work["root"] / "gen.json"
    code, _, err = _run([
        "generate", "--load", str(ckpt), *_tokenizer_flags(work["tok"]), *LLAMA_MODEL,
        "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
        "--micro-batch-size", "1", "--max-new-tokens", "4", "--prompt", "The model",
        "--seed", "42", "--output-json", str(out),
    ], capsys)  # fmt: skip
    assert code == 0, err
    assert "accepted without effect" not in err
    result = json.loads(out.read_text())
    assert 1 <= len(result["sequences"][0]["token_ids"]) <= 4
    # The architecture flags are checked against the checkpoint (every contradiction named at
    # once), and a parallel layout one process cannot run is refused, before any weight is read.
    wrong = [f if f != "2" else "3" for f in LLAMA_MODEL[:2]] + ["--hidden-size", "96"]
    code, _, err = _run(["generate", "--load", str(ckpt), *_tokenizer_flags(work["tok"]), *wrong,
                         "--prompt", "The model"], capsys)  # fmt: skip
    assert code == 2
    assert "--num-layers 3, but the checkpoint has 2" in err
    assert "--hidden-size 96, but the checkpoint has 64" in err
    code, _, err = _run(["generate", "--load", str(ckpt), "--tensor-model-parallel-size", "2",
                         "--prompt", "The model"], capsys)  # fmt: skip
    assert code == 2 and "serve it sharded" in err
    code, _, err = _run(["generate", "--load", str(ckpt), "--lora-r", "8",
                         "--prompt", "The model"], capsys)  # fmt: skip
    assert code == 2 and "--lora-r describes a LoRA adapter, but none is given" in err


def test_evaluate_with_modellink_flags_writes_results(work, pretrained, capsys):
    _, ckpt = pretrained
    out = work["root"] / "eval"
    code, stdout, err = _run([
        "evaluate", "--task-data-path", str(FIXTURES / "boolq"), "--task", "boolq",
        "--seq-length", "32", "--max-new-tokens", "1", "--evaluation-batch-size", "1",
        "--max-position-embeddings", "32", "--tensor-model-parallel-size", "1",
        "--pipeline-model-parallel-size", "1", "--num-layers", "2", "--hidden-size", "64",
        "--ffn-hidden-size", "128", "--load", str(ckpt), "--num-attention-heads", "4",
        *_tokenizer_flags(work["tok"]), "--fp16", "--micro-batch-size", "1", "--seed", "42",
        "--output-path", str(out), "--limit", "2", "--no-progress",
    ], capsys)  # fmt: skip
    assert code == 0, err
    assert "results:" in stdout and "boolq" in stdout
    document = json.loads(next(out.rglob("results*.json")).read_text())
    assert "boolq" in document["results"]
    # --micro-batch-size is the batch size, --fp16 the dtype; a --seq-length past the model's
    # context is refused before the model is built.
    code, _, err = _run([
        "evaluate", "--task-data-path", str(FIXTURES / "boolq"), "--task", "boolq",
        "--load", str(ckpt), "--seq-length", "64", "--output-path", str(out), "--limit", "1",
    ], capsys)  # fmt: skip
    assert code == 2 and "--seq-length 64 is longer than the model's context (32" in err


def test_evaluate_maps_micro_batch_size_and_fp16():
    from services.common import megatron_compat
    from services.evaluator.cli import build_parser

    args = build_parser().parse_args(["--task", "boolq", "--task-data-path", "x", "--fp16",
                                      "--micro-batch-size", "4", "--num-layers", "2"])  # fmt: skip
    compat = megatron_compat.resolve(args)
    assert (args.batch_size, args.dtype) == (4, "float16")
    assert [row.flag for row, _ in compat.checks] == ["--num-layers"]
    args = build_parser().parse_args(["--task", "boolq", "--task-data-path", "x", "--bf16",
                                      "--dtype", "float16"])  # fmt: skip
    with pytest.raises(ValueError, match="--bf16 means --dtype bfloat16, but --dtype float16"):
        megatron_compat.resolve(args)


def test_evaluate_takes_modellink_task_names():
    from services.evaluator.cli import build_parser, task_names

    args = build_parser().parse_args(["--task", "human_eval", "--task-data-path", "x"])
    assert task_names(args.tasks) == ("humaneval",)
    assert task_names("ceval,boolq") == ("ceval-valid", "boolq")


def test_convert_takes_modellink_and_megatron_converter_flags():
    from services.converter.cli import build_parser, options_from_args

    def opts(*argv: str):
        return options_from_args(build_parser().parse_args(list(argv)))

    # tools/ckpt_convert/llama/convert_weights_from_huggingface.py
    o = opts("--input-model-dir", "hf", "--output-model-dir", "out", "--tensor-model-parallel-size",
             "2", "--pipeline-model-parallel-size", "2", "--type", "30B")  # fmt: skip
    assert (o.load_format, o.save_format, o.model, o.target_tp, o.target_pp) == (
        "hf", "megatron", "llama-33B", 2, 2)  # fmt: skip
    assert opts("--input-model-dir", "hf", "--output-model-dir", "o", "--type", "65B",
                "--deepspeed").save_format == "native"  # fmt: skip
    # Megatron-LM tools/checkpoint/convert.py
    o = opts("--model-type", "GPT", "--loader", "llama_mistral", "--saver", "mcore",
             "--load-dir", "hf", "--save-dir", "mg", "--target-tensor-parallel-size", "2",
             "--model-size", "llama2-7Bf", "--checkpoint-type", "hf")  # fmt: skip
    assert (o.load_format, o.save_format, o.model, o.target_tp) == ("hf", "megatron",
                                                                    "llama2-7B", 2)  # fmt: skip
    with pytest.raises(ValueError, match="--model-type BERT"):
        opts("--model-type", "BERT", "--load-dir", "a", "--save-dir", "b")
    with pytest.raises(ValueError, match="--type 3B"):
        opts("--load-dir", "a", "--save-dir", "b", "--type", "3B")


def test_a_wrong_data_path_is_one_line_before_any_worker(work, shards, capsys):
    start = time.monotonic()
    code, _, err = _run([
        "train", "--nproc-per-node", "2", *LLAMA_MODEL, *LLAMA_RUN,
        "--data-path", str(shards) + "_typo", *_tokenizer_flags(work["tok"]),
        "--train-iters", "2", "--global-batch-size", "4",
    ], capsys)  # fmt: skip
    assert code == 2
    lines = [ln for ln in err.splitlines() if ln.strip() and "warning" not in ln]
    assert len(lines) == 1 and "--data-path" in lines[0] and "alpaca_text_document" in lines[0]
    assert time.monotonic() - start < 10, "checked before torchrun"
    code, _, err = _run([
        "train", "--nproc-per-node", "2", *LLAMA_MODEL, *LLAMA_RUN, "--data-path", str(shards),
        "--tokenizer-type", "PretrainedFromHF", "--tokenizer-name-or-path",
        str(work["root"] / "no-tokenizer"), "--train-iters", "2", "--global-batch-size", "4",
    ], capsys)  # fmt: skip
    assert code == 2 and "--tokenizer-name-or-path" in err and "no such directory" in err
    code, _, err = _run(["train", *LLAMA_MODEL, "--mock-data", "--train-iters", "2",
                         "--load", str(work["root"] / "typo-ckpt")], capsys)  # fmt: skip
    assert code == 2 and "no checkpoint to resume from" in err and "--load" in err


@pytest.mark.dist
@pytest.mark.slow
def test_two_process_pretrain_through_torchrun(work, shards, capfd):
    save = work["root"] / "ckpt-2p"
    code, _, err = _run([
        "train", "--nproc-per-node", "2", *LLAMA_MODEL, *LLAMA_RUN, "--data-path", str(shards),
        *_tokenizer_flags(work["tok"]), "--global-batch-size", "4", "--train-iters", "2",
        "--lr-decay-iters", "2", "--save", str(save), "--load", str(save),
        "--use-distributed-optimizer", "--sequence-parallel", "--tensor-model-parallel-size", "2",
    ], capfd)  # fmt: skip
    assert code == 0, err[-3000:]
    assert (save / "latest").read_text().strip() == "2"
    assert "accepted without effect" not in err, err[-3000:]  # every flag has its effect


def test_torch_distributed_launch_args_are_launcher_flags(work, shards, capsys):
    # DISTRIBUTED_ARGS of ModelLink's scripts, in front of the training flags.
    launch = ["--nproc_per_node", "2", "--nnodes", "1", "--node_rank", "0",
              "--master_addr", "localhost", "--master_port", "6000"]  # fmt: skip
    code, _, err = _run(["train", *launch, *LLAMA_MODEL, *LLAMA_RUN, "--global-batch-size", "4",
                         "--data-path", str(shards) + "_x", *_tokenizer_flags(work["tok"])],
                        capsys)  # fmt: skip
    assert code == 2 and "unrecognized" not in err and "--data-path" in err, err
