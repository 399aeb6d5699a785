"""The pre-launch checks of a training run: everything its config decides, before any worker
starts or weight is read (the one such module; `meshline train` and the trainer service call it).

- `check_paths(config)`: every path and tokenizer flag, one ValueError line naming the flag and
  the fix, so a wrong `--data-path` is reported at once instead of by every worker under a
  traceback.
- `load_action(config)`: how `--load` is honoured under Megatron's resume rules.
- `check_inputs(config)`: opens every dataset as the trainer will and checks the tokenizer and
  checkpoint folders (FileNotFoundError for what is missing, the service's NOT_FOUND; ValueError
  for what is unreadable); its `--load` check follows `load_action`, so that `--load X --save X`
  on a fresh directory keeps working.
- `check_model_layout(config, world_size)`: the model the flags define (registry or Megatron
  architecture flags, the tokenizer's vocabulary) against the TP/PP/EP layout, with the check the
  workers run (`parallel.parallelize.check_model`, i.e. `models.parallel_plan.check_split`), and
  against DPO's `--ref-model` (same vocabulary and architecture).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from models.tokenizer import build_tokenizer
from parallel.parallel_dims import build_dims
from parallel.parallelize import check_model
from parallel.pipeline import virtual_chunks
from tokendata.datasets.pairwise import PairSource
from tokendata.datasets.sources import detect_format, open_instruction, open_pretraining
from training.checkpoint import check_resumable, latest_train_state
from training.config import TrainingConfig
from training.objectives.layout import PREFERENCE_STAGES, RL_STAGES
from training.objectives.reference import (
    check_reference_config,
    read_reference_config,
    reference_step_dir,
)
from training.prompt_data import read_prompts
from training.resume_check import check_same_model
from training.setup import build_model_config


def has_checkpoint(directory: str | Path) -> bool:
    """True when `directory` holds a saved step (its `latest` pointer)."""
    return (Path(directory) / "latest").is_file()


def load_action(config: TrainingConfig) -> Literal["none", "resume", "fresh"]:
    """What `--load` does: none (not given), resume (a checkpoint is there), fresh (start at step 0).

    Megatron's rule: `--load DIR` without a checkpoint in it starts from scratch, which is how a
    job given `--load X --save X` resumes by itself after a restart. The exceptions raise
    ValueError: --exit-on-missing-checkpoint, --finetune or a PEFT method (they need base
    weights), and a --load directory that does not exist and is not the --save directory (a typo).
    """
    run = config.run
    if not run.load:
        return "none"
    if has_checkpoint(run.load):
        _check_resumable(config, run.load)
        return "resume"
    load = Path(run.load)
    same_as_save = run.save is not None and Path(run.save).resolve() == load.resolve()
    why = f"no checkpoint to resume from: --load {run.load} " + (
        "does not exist" if not load.exists() else "holds no saved step (no 'latest' file)"
    )
    if run.exit_on_missing_checkpoint:
        raise ValueError(f"{why} (--exit-on-missing-checkpoint)")
    if run.finetune or config.peft.peft_method is not None:
        raise ValueError(
            f"{why}; --finetune and PEFT runs need the base weights there (convert a HF model "
            "with `meshline convert`)"
        )
    if load.exists() and not load.is_dir():
        raise ValueError(f"--load {run.load} is a file; pass a checkpoint directory")
    if not load.exists() and not same_as_save:
        raise ValueError(
            f"{why}; check the path, or pass the same directory to --load and --save to start "
            "fresh now and resume from it after a restart"
        )
    return "fresh"


def _check_resumable(config: TrainingConfig, load: str) -> None:
    """A resume that asks for optimizer or RNG state the latest checkpoint was saved without
    (--no-save-optim, --no-save-rng) is refused here, naming the flag, not in every worker."""

    run = config.run
    if run.finetune or config.peft.peft_method is not None:  # the weights only
        return
    latest = latest_train_state(load)
    if latest is not None:
        path, meta = latest
        check_resumable(meta, path, optimizer=not run.no_load_optim, rng=not run.no_load_rng)
        check_same_model(config, path)


def _prefixes(paths: list[str]) -> list[str]:
    """The dataset prefixes of a weighted list (`0.3 a 0.7 b` -> a, b)."""
    out = []
    for item in paths:
        try:
            float(item)
        except ValueError:
            out.append(item)
    return out


def _check_dataset(flag: str, prefix: str, instruction: bool) -> None:

    try:
        detect_format(prefix, instruction)
    except FileNotFoundError as exc:
        message = str(exc).replace("--data-path", flag, 1)
        parent = Path(prefix).parent
        if not parent.is_dir():
            message = (
                f"{flag} {prefix!r}: directory {str(parent)!r} does not exist; pass the "
                "prefix `meshline preprocess --output-prefix` wrote (e.g. dir/name_text_document)"
            )
        elif not instruction:
            near = sorted(p.name[: -len(".idx")] for p in parent.glob("*.idx"))
            if near:
                message += f"; prefixes in {parent}: {', '.join(near[:5])}"
        raise ValueError(message) from None


def _check_pairs(flag: str, prefix: str, data_format: str) -> None:
    """A preference stage's prefix holds pairwise shards (tokendata/datasets/pairwise.py)."""

    try:
        PairSource(prefix, data_format)
    except ValueError as exc:
        raise ValueError(str(exc).replace("--data-path", flag, 1)) from None


def _check_tokenizer(config: TrainingConfig) -> None:
    data = config.data
    kind = data.tokenizer_type
    if kind is None:
        return
    if kind == "SentencePiece":
        path = data.tokenizer_model
        if path is None:
            raise ValueError(
                "--tokenizer-type SentencePiece needs --tokenizer-model PATH (the .model file)"
            )
        if not Path(path).is_file():
            raise ValueError(
                f"--tokenizer-model {path}: no such file; pass the SentencePiece .model file"
            )
        return
    path = data.tokenizer_name_or_path
    if path is None:
        raise ValueError(
            "--tokenizer-type PretrainedFromHF needs --tokenizer-name-or-path DIR (a local HF "
            "tokenizer directory)"
        )
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(
            f"--tokenizer-name-or-path {path}: no such directory; pass a local directory holding "
            "tokenizer.json or tokenizer_config.json (hub names are not downloaded)"
        )
    wanted = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any((folder / name).is_file() for name in wanted):
        raise ValueError(
            f"--tokenizer-name-or-path {path}: holds none of {', '.join(wanted)}; pass the "
            "directory of a saved HF tokenizer"
        )


def check_paths(config: TrainingConfig) -> None:
    """Raise ValueError (one line: the flag and the fix) for any path flag that cannot work."""
    data = config.data
    if not data.mock_data:
        for flag, paths in (
            ("--data-path", data.data_path),
            ("--train-data-path", data.train_data_path),
            ("--valid-data-path", data.valid_data_path),
            ("--test-data-path", data.test_data_path),
        ):
            for prefix in _prefixes(paths):
                if config.run.stage in RL_STAGES:
                    if not Path(prefix).is_file():
                        raise ValueError(
                            f"{flag} {prefix}: no such file; --stage {config.run.stage} reads a "
                            'JSON-lines prompt file (one {"prompt": ..., "answer": ...} a line)'
                        )
                elif config.run.stage in PREFERENCE_STAGES:
                    _check_pairs(flag, prefix, data.data_format)
                else:
                    _check_dataset(flag, prefix, data.is_instruction_dataset)
    _check_tokenizer(config)
    action = load_action(config)
    rl_reference = config.run.stage == "ppo" or (config.run.stage == "grpo" and config.rl.beta)
    if action == "resume" and rl_reference and not config.run.finetune:
        raise ValueError(
            f"--stage {config.run.stage} with --load {config.run.load}: resuming is not supported "
            "(the reference is the run's starting weights, which a checkpoint does not hold); "
            "start again from the weights with --load DIR --finetune"
            + (", or resume with --beta 0" if config.run.stage == "grpo" else "")
        )
    run = config.run
    if (
        action == "resume"
        and run.stage == "dpo"
        and not run.finetune
        and run.ref_model is None
        and config.peft.peft_method is None
    ):
        raise ValueError(
            f"--stage dpo with --load {run.load}: resuming needs the reference, which is the "
            "run's starting weights and not in the checkpoint; pass them as --ref-model DIR "
            "(e.g. the SFT checkpoint the run started from), or start anew from the saved "
            "weights with --finetune"
        )
    if run.ref_model is not None:
        if not Path(run.ref_model).is_dir():
            raise ValueError(
                f"--ref-model {run.ref_model}: no such directory; pass the reference's trainer "
                "--save directory (or a step-XXXXXX in it)"
            )
        reference_step_dir(run.ref_model)
    for flag, value in (
        ("--save", run.save),
        ("--log-dir", run.log_dir),
        ("--profile-save-path", run.profile_dir() if run.profile else None),
    ):
        if value is not None and Path(value).exists() and not Path(value).is_dir():
            raise ValueError(f"{flag} {value} is a file; pass a directory")
    lora = config.peft.lora_load
    if lora is not None and not Path(lora).is_dir():
        raise ValueError(
            f"--lora-load {lora}: no such directory; pass an adapter directory (peft or "
            "Meshline) or a LoRA run's --save directory"
        )


_DATA_FLAGS = (
    ("data_path", "--data-path"),
    ("train_data_path", "--train-data-path"),
    ("valid_data_path", "--valid-data-path"),
    ("test_data_path", "--test-data-path"),
)


def check_data(config: TrainingConfig) -> None:
    """Opens every data prefix as the trainer will (FileNotFoundError / ValueError naming it)."""

    data = config.data
    for name, flag in _DATA_FLAGS:
        for prefix in _prefixes(getattr(data, name)):
            if config.run.stage in PREFERENCE_STAGES:  # pairwise shards, not token ones
                _check_pairs(flag, prefix, data.data_format)
                continue
            if config.run.stage in RL_STAGES:  # a JSON-lines prompt file, read as the trainer does
                read_prompts(prefix, flag)
                continue
            try:
                if data.is_instruction_dataset:
                    open_instruction(prefix, data.data_format)
                else:
                    open_pretraining(prefix, data.data_format)
            except FileNotFoundError as exc:
                raise FileNotFoundError(f"{flag} {prefix}: {exc}") from None
            except (ValueError, OSError) as exc:
                raise ValueError(f"{flag} {prefix}: not a readable dataset: {exc}") from None


def check_tokenizer(config: TrainingConfig) -> None:
    """The tokenizer file (SentencePiece) or folder (HF) exists (FileNotFoundError naming it)."""
    data = config.data
    if data.tokenizer_model and not Path(data.tokenizer_model).is_file():
        raise FileNotFoundError(
            f"--tokenizer-model {data.tokenizer_model}: no such file; pass the SentencePiece "
            ".model file"
        )
    if data.tokenizer_name_or_path and not Path(data.tokenizer_name_or_path).is_dir():
        raise FileNotFoundError(
            f"--tokenizer-name-or-path {data.tokenizer_name_or_path}: no such directory; pass a "
            "local directory holding tokenizer.json or tokenizer_config.json (hub names are not "
            "downloaded)"
        )


def check_checkpoints(config: TrainingConfig) -> None:
    """--load follows Megatron's rule (`load_action`: a missing or empty folder starts fresh when
    it is also --save); --lora-load names an existing folder."""
    try:
        load_action(config)
    except ValueError as exc:
        missing = config.run.load is not None and not Path(config.run.load).exists()
        raise (FileNotFoundError if missing else ValueError)(str(exc)) from None
    lora = config.peft.lora_load
    if lora and not Path(lora).is_dir():
        raise FileNotFoundError(f"--lora-load {lora}: no such checkpoint folder")
    ref = config.run.ref_model
    if ref and not Path(ref).is_dir():
        raise FileNotFoundError(f"--ref-model {ref}: no such checkpoint folder")


def check_inputs(config: TrainingConfig) -> None:
    """Every input of the run exists and is readable (FileNotFoundError / ValueError)."""
    if not config.data.mock_data:
        check_tokenizer(config)
        check_data(config)
    check_checkpoints(config)


def check_model_layout(config: TrainingConfig, world_size: int) -> None:
    """The model the flags define fits the parallel layout of `world_size` ranks (ValueError
    naming the flag), checked as the workers will check it but before any of them starts."""

    model_config = build_model_config(config, _tokenizer_vocab(config))
    dims = build_dims(config, world_size)
    par = config.parallel
    dims.virtual_pp = virtual_chunks(
        model_config.num_layers, dims.pp, par.num_layers_per_virtual_pipeline_stage
    )
    check_model(dims, model_config, config.parallel_config())
    if config.run.ref_model is not None:  # DPO's reference: the policy's vocabulary and model
        reference = read_reference_config(config.run.ref_model)
        check_reference_config(reference, model_config, config.run.ref_model)


def _tokenizer_vocab(config: TrainingConfig) -> int | None:
    """The tokenizer's vocabulary (what the workers pad the model's to); None for --mock-data."""
    data = config.data
    source = data.tokenizer_model or data.tokenizer_name_or_path
    if data.mock_data or data.tokenizer_type is None or source is None:
        return None

    tokenizer = build_tokenizer(
        data.tokenizer_type, source, use_fast=not data.tokenizer_not_use_fast
    )
    return tokenizer.vocab_size
