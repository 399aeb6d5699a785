"""`meshline convert`'s command line, pinned: every spelling it has taken parses, and a set of
command lines (ModelLink's and Megatron-LM's conversion-script spellings among them) gives the
same `ConvertOptions` or the same error as when the flags were written by hand. The expected
values were produced by that hand-written parser and are hard-coded here."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from services.converter.cli import build_parser, options_from_args
from services.converter.job import ConvertOptions

# flag -> a value it accepts ([] for a switch)
SPELLINGS: dict[str, list[str]] = {
    "--load-format": ["hf"], "--save-format": ["native"], "--load-dir": ["a"],
    "--input-model-dir": ["a"], "--load": ["a"], "--save-dir": ["b"],
    "--output-model-dir": ["b"], "--save": ["b"], "--model": ["tiny-llama"], "--type": ["7B"],
    "--target-tensor-parallel-size": ["2"], "--tensor-model-parallel-size": ["2"],
    "--target-pipeline-parallel-size": ["2"], "--pipeline-model-parallel-size": ["2"],
    "--num-layers-per-virtual-pipeline-stage": ["2"], "--make-vocab-size-divisible-by": ["64"],
    "--load-iteration": ["3"], "--lora-load": ["l"], "--lora-r": ["8"], "--lora-alpha": ["16"],
    "--merge-lora": [], "--dtype": ["bf16"], "--params-dtype": ["fp16"], "--verify": [],
    "--no-verify": [], "--verify-tolerance": ["0.1"], "--overwrite": [],
    "--max-shard-size-mb": ["10"], "--gguf-type": ["Q8_0"], "--quantize": ["int8"],
    "--group-size": ["32"], "--quantize-affine": [], "--ppo-model": ["critic"],
    "--keep-embedding": [], "--quantize-method": ["gptq"], "--method": ["rtn"],
    "--calibration-data": ["shard"], "--calibration-samples": ["8"],
    "--calibration-seq-len": ["64"], "--gptq-act-order": [], "--gptq-damp": ["0.02"],
    "--deepspeed": [], "--model-type": ["GPT"], "--loader": ["mcore"],
    "--saver": ["hf"], "--model-size": ["llama2-7B"], "--checkpoint-type": ["hf"],
    "--lora-target-modules": ["dense", "query_key_value"], "--megatron-path": ["/opt/m"],
    "--tokenizer-model": ["tok.model"], "--fp16": [], "--bf16": [],
}  # fmt: skip

CASES = [
    # ModelLink tools/ckpt_convert/llama/convert_weights_from_huggingface.py
    ("--input-model-dir hf --output-model-dir out --tensor-model-parallel-size 2 "
     "--pipeline-model-parallel-size 2 --type 30B",
     ConvertOptions(load_format="hf", save_format="megatron", load_dir=Path("hf"),
                    save_dir=Path("out"), model="llama-33B", target_tp=2, target_pp=2)),
    ("--input-model-dir hf --output-model-dir o --type 65B --deepspeed",
     ConvertOptions(load_format="hf", save_format="native", load_dir=Path("hf"),
                    save_dir=Path("o"), model="llama-65B")),
    # Megatron-LM tools/checkpoint/convert.py
    ("--model-type GPT --loader llama_mistral --saver mcore --load-dir hf --save-dir mg "
     "--target-tensor-parallel-size 2 --model-size llama2-7Bf --checkpoint-type hf "
     "--megatron-path /opt/megatron",
     ConvertOptions(load_format="hf", save_format="megatron", load_dir=Path("hf"),
                    save_dir=Path("mg"), model="llama2-7B", target_tp=2)),
    # ModelLink's LoRA merge
    ("--load mg --lora-load lora --save merged --lora-r 8 --lora-alpha 16 "
     "--lora-target-modules query_key_value dense",
     ConvertOptions(load_format="megatron", save_format="megatron", load_dir=Path("mg"),
                    save_dir=Path("merged"), lora_dir=Path("lora"), lora_r=8, lora_alpha=16.0,
                    lora_target_modules=("query_key_value", "dense"))),
    ("--load-format native --save-format megatron --load-dir a --save-dir b "
     "--target-pipeline-parallel-size 4 --num-layers-per-virtual-pipeline-stage 2 "
     "--make-vocab-size-divisible-by 64 --load-iteration 3 --params-dtype bf16 --no-verify "
     "--overwrite",
     ConvertOptions(load_format="native", save_format="megatron", load_dir=Path("a"),
                    save_dir=Path("b"), target_pp=4, layers_per_virtual_stage=2, dtype="bf16",
                    verify=False, load_iteration=3, overwrite=True,
                    make_vocab_size_divisible_by=64)),
    ("--load-format megatron --save-format hf --load a --save b --max-shard-size-mb 10 --verify "
     "--verify-tolerance 0.01 --model tiny-llama",
     ConvertOptions(load_format="megatron", save_format="hf", load_dir=Path("a"),
                    save_dir=Path("b"), model="tiny-llama", verify=True, verify_tolerance=0.01,
                    max_shard_bytes=10485760)),
    ("--load-format hf --save-format gguf --load a --save b --gguf-type Q8_0",
     ConvertOptions(load_format="hf", save_format="gguf", load_dir=Path("a"), save_dir=Path("b"),
                    gguf_type="Q8_0")),
    ("--save-format quantized --quantize int4 --group-size 64 --quantize-affine --keep-embedding "
     "--load a --save b --tokenizer-model tok.model --dtype fp16",
     ConvertOptions(load_format="hf", save_format="quantized", load_dir=Path("a"),
                    save_dir=Path("b"), dtype="fp16", quantize="int4", group_size=64,
                    quantize_affine=True, keep_embedding=True,
                    tokenizer_model=Path("tok.model"))),
    ("--load-format native --save-format hf --ppo-model critic --load a --save b",
     ConvertOptions(load_format="native", save_format="hf", load_dir=Path("a"),
                    save_dir=Path("b"), ppo_model="critic")),
    ("--load-format megatron --save-format hf --load a --save b --fp16",
     ConvertOptions(load_format="megatron", save_format="hf", load_dir=Path("a"),
                    save_dir=Path("b"), dtype="fp16")),
    ("--input-model-dir a --output-model-dir b --bf16 --params-dtype bf16",
     ConvertOptions(load_format="hf", save_format="megatron", load_dir=Path("a"),
                    save_dir=Path("b"), dtype="bf16")),
    ("--load-dir a --save-dir b --lora-load l --merge-lora --load-format hf --save-format hf "
     "--saver hf",
     ConvertOptions(load_format="hf", save_format="hf", load_dir=Path("a"), save_dir=Path("b"),
                    lora_dir=Path("l"))),
]  # fmt: skip

ERRORS = [
    ("--model-type BERT --load-dir a --save-dir b",
     "--model-type BERT: only GPT (decoder-only) checkpoints are converted"),
    ("--load-dir a --save-dir b --type 3B",
     "--type 3B: known sizes 7B, 13B, 30B, 33B, 65B, 34B, 70B; other models: --model NAME"),
    ("--load-dir a --save-dir b --checkpoint-type meta",
     "--checkpoint-type meta: convert Meta's .pth release to HF first"),
    ("--load-dir a --save-dir b --merge-lora",
     "--merge-lora needs --lora-load DIR (the adapter to merge)"),
    ("--load x --save y --lora-target-modules dense",
     "--lora-target-modules describes the adapter to merge; give it with --lora-load DIR"),
    ("--load x --save y --saver mcore --deepspeed",
     "--deepspeed means --save-format native, but --save-format megatron is given; drop one"),
    ("--load x --save y --loader hf --load-format megatron",
     "--loader hf means --load-format hf, but --load-format megatron is given; drop one"),
    ("--load x --save y --max-shard-size-mb 0", "--max-shard-size-mb must be >= 1"),
    ("--load x --save y --model-size llama2-7B --model tiny-llama",
     "--model-size llama2-7B means --model llama2-7B, but --model tiny-llama is given; drop one"),
    ("--load x --save y --type 7B --model-size llama2-13B",
     "--type 7B means --model llama2-7B, but --model llama2-13B is given; drop one"),
    # --fp16/--bf16 once stored a dtype ConvertOptions refuses ("float16"); a contradiction with
    # --dtype was decided by the order of the flags
    ("--load x --save y --fp16 --dtype bf16",
     "--fp16 means --dtype fp16, but --dtype bf16 is given; drop one"),
    ("--load x --save y --fp16 --bf16",
     "--bf16 means --dtype bf16, but --dtype fp16 is given; drop one"),
]  # fmt: skip


def _options(line: str) -> ConvertOptions:
    return options_from_args(build_parser().parse_args(shlex.split(line)))


def test_every_spelling_is_a_flag_and_parses():
    parser = build_parser()
    spellings = {s for action in parser._actions for s in action.option_strings}
    assert spellings == {"-h", "--help", *SPELLINGS}
    for flag, values in SPELLINGS.items():
        base = [] if flag in ("--load-dir", "--input-model-dir", "--load") else ["--load-dir", "a"]
        if flag not in ("--save-dir", "--output-model-dir", "--save"):
            base += ["--save-dir", "b"]
        parser.parse_args([*base, flag, *values])


@pytest.mark.parametrize(("line", "expected"), CASES)
def test_command_lines_give_the_same_options(line, expected):
    assert _options(line) == expected


@pytest.mark.parametrize(("line", "message"), ERRORS)
def test_command_lines_give_the_same_errors(line, message):
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        _options(line)
