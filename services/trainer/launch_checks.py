"""Checks of every path and tokenizer flag of a training config, before any worker starts.

`check_paths(config)` raises ValueError with one line naming the flag and the fix; `meshline
train` calls it before torchrun (or the in-process run) so a wrong `--data-path` is reported at
once instead of by every worker under a traceback. `load_action(config)` tells how `--load` is
honoured under Megatron's resume rules. Both read only the parsed config, so a service can reuse
them on a request's config. `preflight.check_inputs` then opens the datasets and tokenizer
(what the trainer service runs too); its `--load` check follows `load_action`, so that
`--load X --save X` on a fresh directory keeps working.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from services.trainer.train_config import TrainConfig
from training.objectives.layout import PREFERENCE_STAGES


def has_checkpoint(directory: str | Path) -> bool:
    """True when `directory` holds a saved step (its `latest` pointer)."""
    return (Path(directory) / "latest").is_file()


def load_action(config: TrainConfig) -> Literal["none", "resume", "fresh"]:
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


def _check_resumable(config: TrainConfig, load: str) -> None:
    """A resume that asks for optimizer or RNG state the latest checkpoint was saved without
    (--no-save-optim, --no-save-rng) is refused here, naming the flag, not in every worker."""
    from training.checkpoint import check_resumable, latest_train_state

    run = config.run
    if run.finetune or config.peft.peft_method is not None:  # the weights only
        return
    latest = latest_train_state(load)
    if latest is not None:
        path, meta = latest
        check_resumable(meta, path, optimizer=not run.no_load_optim, rng=not run.no_load_rng)


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
    from tokendata.datasets.sources import detect_format

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
    from tokendata.datasets.pairwise import PairSource

    try:
        PairSource(prefix, data_format)
    except ValueError as exc:
        raise ValueError(str(exc).replace("--data-path", flag, 1)) from None


def _check_tokenizer(config: TrainConfig) -> None:
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


def check_paths(config: TrainConfig) -> None:
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
                if config.run.stage in PREFERENCE_STAGES:
                    _check_pairs(flag, prefix, data.data_format)
                else:
                    _check_dataset(flag, prefix, data.is_instruction_dataset)
    _check_tokenizer(config)
    action = load_action(config)
    if action == "resume" and config.run.stage == "dpo" and not config.run.finetune:
        raise ValueError(
            f"--stage dpo with --load {config.run.load}: resuming is not supported (the reference "
            "is the run's starting weights, which a checkpoint does not hold); start from the "
            "SFT weights with --load DIR --finetune"
        )
    run = config.run
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
