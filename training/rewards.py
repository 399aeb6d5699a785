"""Reward functions for online RL, chosen by name (trl's `reward_funcs`) and combined with weights.

Each scores a batch of `Sample`s (training/objectives/rollouts.py: prompt ids, the completion's
ids and text, the prompt's record) and returns rewards [N]:

- `exact_match`: 1 when the completion's text, stripped, equals the record's `answer`, stripped.
- `gsm8k`: GSM8K answer match as the evaluator scores it (lm-eval's gsm8k): the gold number is
  what follows "####" in `answer` (the whole answer without one); the completion's answer is the
  number after "#### " when it writes one, else its last number; both lose thousands
  separators, dollar signs and a final period before comparing.
- `regex`: 1 when the pattern (--reward-regex) matches the completion's text (re.search).
- `reward_model`: the score of a reward model trained with `--stage rm` (its value head on the
  last token of prompt + completion), run in process on the trainer's device.

Several are summed with weights (--reward-weights, trl's name; default 1 each), as trl's
"sum_then_normalize".
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from checkpoints.native_format import find_step
from checkpoints.safe_reader import SafeFileSystemReader
from models import build_model
from models.config import ModelConfig
from models.value_head import attach_value_head, has_value_head
from training.objectives.rollouts import RewardFn, Sample

REWARD_FUNCS = ("exact_match", "gsm8k", "regex", "reward_model")
"""Reward function names (--reward-funcs)."""
MAX_REGEX_CHARS = 1000
"""Longest --reward-regex accepted."""
_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_LAST_NUMBER = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")
_IGNORED = (",", r"\$", r"\.$")


def _answer(sample: Sample) -> str:
    answer = sample.record.get("answer")
    if not isinstance(answer, str | int | float):
        raise ValueError(
            "reward exact_match/gsm8k needs an `answer` (text or number) in every prompt record"
        )
    return str(answer)


def exact_match(samples: Sequence[Sample]) -> torch.Tensor:
    """1 where the completion's stripped text equals the record's stripped `answer`."""
    return torch.tensor([float(s.completion.text.strip() == _answer(s).strip()) for s in samples])


def _clean_number(text: str) -> str:
    for pattern in _IGNORED:
        text = re.sub(pattern, "", text)
    return text.strip()


def gsm8k_answer(text: str) -> str | None:
    """The answer a GSM8K completion gives: after "#### ", else its last number (None: none)."""
    strict = _STRICT.findall(text)
    if strict:
        return _clean_number(strict[0])
    matches = _LAST_NUMBER.findall(text)
    if not matches:
        return None
    last = next((m for m in matches[-1] if m), "")
    return _clean_number(last) or None


def gsm8k(samples: Sequence[Sample]) -> torch.Tensor:
    """1 where the completion's answer equals the gold number after "####"."""
    rewards = []
    for sample in samples:
        gold = _clean_number(_answer(sample).split("####")[-1])
        given = gsm8k_answer(sample.completion.text)
        rewards.append(float(given is not None and given == gold))
    return torch.tensor(rewards)


def regex_reward(pattern: str) -> RewardFn:
    """1 where `pattern` matches somewhere in the completion's text."""
    if not pattern or len(pattern) > MAX_REGEX_CHARS:
        raise ValueError(f"--reward-regex: give a pattern of 1 to {MAX_REGEX_CHARS} characters")
    try:
        compiled = re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"--reward-regex {pattern!r} is not a regular expression ({exc})") from exc

    def score(samples: Sequence[Sample]) -> torch.Tensor:
        return torch.tensor(
            [float(compiled.search(s.completion.text) is not None) for s in samples]
        )

    return score


def load_reward_model(directory: str | Path, device: torch.device | str = "cpu") -> nn.Module:
    """The reward model a `--stage rm` run saved (its --save directory or a step-XXXXXX), in
    fp32 on `device`, frozen."""
    try:
        step_dir = find_step(Path(directory))
    except (FileNotFoundError, ValueError) as exc:
        raise ValueError(f"--reward-model {directory}: {exc}") from exc
    config_path = step_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"--reward-model {directory}: {config_path} is missing")
    try:
        config = ModelConfig.from_dict(json.loads(config_path.read_text()))
    except (json.JSONDecodeError, UnicodeDecodeError, TypeError, AttributeError) as exc:
        raise ValueError(f"--reward-model {directory}: {config_path} is corrupted ({exc})") from exc
    model = attach_value_head(build_model(config, device="cpu"))
    state = {f"model.{name}": t for name, t in model.state_dict().items()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process.*")
        try:
            dcp.load(state, storage_reader=SafeFileSystemReader(step_dir), no_dist=True)
        except (Exception, dcp.CheckpointException) as exc:
            raise ValueError(
                f"--reward-model {directory}: not a `--stage rm` checkpoint of this shape ({exc})"
            ) from exc
    model.load_state_dict({name.removeprefix("model."): t for name, t in state.items()})
    return model.to(device).requires_grad_(False).eval()


def reward_model_reward(model: nn.Module, pad_id: int = 0) -> RewardFn:
    """The reward model's score of each prompt + completion (its last token's value)."""
    if not has_value_head(model):
        raise ValueError("--reward-model: the model has no scalar value head (a --stage rm run)")
    device = next(model.parameters()).device

    @torch.no_grad()
    def score(samples: Sequence[Sample]) -> torch.Tensor:
        rows = [s.prompt_ids + list(s.completion.token_ids) for s in samples]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        last = torch.tensor([len(r) - 1 for r in rows])
        scores_BS1 = model(ids.to(device))
        return scores_BS1[torch.arange(len(rows)), last.to(device), 0].float().cpu()

    return score


def combine(funcs: Sequence[RewardFn], weights: Sequence[float]) -> RewardFn:
    """Σ_k w_k r_k per sample."""
    if len(funcs) != len(weights):
        raise ValueError(
            f"--reward-weights has {len(weights)} value(s) for {len(funcs)} --reward-funcs"
        )

    def score(samples: Sequence[Sample]) -> torch.Tensor:
        total = torch.zeros(len(samples))
        for func, weight in zip(funcs, weights, strict=True):
            total += weight * func(samples).float()
        return total

    return score


def build_reward(
    names: Sequence[str],
    weights: Sequence[float] = (),
    *,
    regex: str | None = None,
    reward_model: Callable[[], nn.Module] | None = None,
    pad_id: int = 0,
) -> RewardFn:
    """The weighted sum of the named reward functions; ValueError naming the flag at fault."""
    check_reward_flags(names, weights, regex, reward_model is not None)
    funcs: list[RewardFn] = []
    for name in names:
        if name == "exact_match":
            funcs.append(exact_match)
        elif name == "gsm8k":
            funcs.append(gsm8k)
        elif name == "regex":
            assert regex is not None
            funcs.append(regex_reward(regex))
        else:
            assert reward_model is not None
            funcs.append(reward_model_reward(reward_model(), pad_id))
    return combine(funcs, list(weights) if weights else [1.0] * len(funcs))


def check_reward_flags(
    names: Sequence[str], weights: Sequence[float], regex: str | None, reward_model: bool
) -> None:
    """Refuse reward settings that cannot work, naming the flag (reads no weights)."""
    if not names:
        raise ValueError(f"--reward-funcs: name at least one of {list(REWARD_FUNCS)}")
    unknown = [n for n in names if n not in REWARD_FUNCS]
    if unknown:
        raise ValueError(f"--reward-funcs {unknown}: known are {list(REWARD_FUNCS)}")
    if len(set(names)) != len(names):
        raise ValueError(f"--reward-funcs {list(names)} names one function twice")
    if regex is not None and "regex" not in names:
        raise ValueError("--reward-regex applies to --reward-funcs regex; add it or drop the flag")
    if reward_model and "reward_model" not in names:
        raise ValueError(
            "--reward-model applies to --reward-funcs reward_model; add it or drop the flag"
        )
    if "regex" in names:
        if regex is None:
            raise ValueError("--reward-funcs regex needs --reward-regex PATTERN")
        regex_reward(regex)
    if "reward_model" in names and not reward_model:
        raise ValueError("--reward-funcs reward_model needs --reward-model DIR")
    if weights and len(weights) != len(names):
        raise ValueError(
            f"--reward-weights has {len(weights)} value(s) for {len(names)} --reward-funcs"
        )
