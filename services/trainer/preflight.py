"""Checks of a training run's inputs before any worker starts.

`TrainConfig.validate` checks the settings against each other; `check_inputs` checks what they
point at: every data prefix opens as a dataset (files present, `.idx` header and sizes
consistent, Arrow shards readable), and the tokenizer file or folder exists. The trainer service
runs it before launching (so a missing shard is NOT_FOUND and a corrupt one INVALID_ARGUMENT,
naming the flag, instead of a job that dies in torchrun), and so does `meshline train`.
"""

from __future__ import annotations

from pathlib import Path

from services.trainer.train_config import TrainConfig

_DATA_FLAGS = (
    ("data_path", "--data-path"),
    ("train_data_path", "--train-data-path"),
    ("valid_data_path", "--valid-data-path"),
    ("test_data_path", "--test-data-path"),
)


def _prefixes(values: list[str]) -> list[str]:
    out = []
    for token in values:
        try:
            float(token)
        except ValueError:
            out.append(token)
    return out


def check_data(config: TrainConfig) -> None:
    """Opens every data prefix as the trainer will (FileNotFoundError / ValueError naming it)."""
    from tokendata.datasets.sources import open_instruction, open_pretraining

    data = config.data
    for name, flag in _DATA_FLAGS:
        for prefix in _prefixes(getattr(data, name)):
            try:
                if data.is_instruction_dataset:
                    open_instruction(prefix, data.data_format)
                else:
                    open_pretraining(prefix, data.data_format)
            except FileNotFoundError as exc:
                raise FileNotFoundError(f"{flag} {prefix}: {exc}") from None
            except (ValueError, OSError) as exc:
                raise ValueError(f"{flag} {prefix}: not a readable dataset: {exc}") from None


def check_tokenizer(config: TrainConfig) -> None:
    """The tokenizer file (SentencePiece) or folder (HF) exists."""
    data = config.data
    if data.tokenizer_model and not Path(data.tokenizer_model).is_file():
        raise FileNotFoundError(f"--tokenizer-model {data.tokenizer_model}: no such file")
    if data.tokenizer_name_or_path and not Path(data.tokenizer_name_or_path).is_dir():
        raise FileNotFoundError(
            f"--tokenizer-name-or-path {data.tokenizer_name_or_path}: no such folder (give a "
            "local HF tokenizer directory)"
        )


def check_checkpoints(config: TrainConfig) -> None:
    """--load follows Megatron's rule (`launch_checks.load_action`: a missing or empty folder
    starts fresh when it is also --save); --lora-load names an existing folder."""
    from services.trainer.launch_checks import load_action

    try:
        load_action(config)
    except ValueError as exc:
        missing = config.run.load is not None and not Path(config.run.load).exists()
        raise (FileNotFoundError if missing else ValueError)(str(exc)) from None
    lora = config.peft.lora_load
    if lora and not Path(lora).is_dir():
        raise FileNotFoundError(f"--lora-load {lora}: no such checkpoint folder")


def check_inputs(config: TrainConfig) -> None:
    """Every input of the run exists and is readable (FileNotFoundError / ValueError)."""
    if not config.data.mock_data:
        check_tokenizer(config)
        check_data(config)
    check_checkpoints(config)
