"""engine/reward.py: batched last-token rewards equal each row's own forward; the request rules
of engine/validation.py for reward inputs."""

from __future__ import annotations

import pytest
import torch

from engine.reward import RewardScorer
from engine.validation import RewardLimits, reward_problems
from models import build_model
from models.registry import get_config
from models.value_head import attach_value_head


def test_batched_rewards_equal_each_row_alone() -> None:
    torch.manual_seed(0)
    model = attach_value_head(build_model(get_config("tiny-llama"), device="cpu"), seed=1).eval()
    gen = torch.Generator().manual_seed(2)
    rows = [torch.randint(4, 200, (n,), generator=gen).tolist() for n in (7, 3, 12, 1, 9, 12)]
    # A 24-token budget: batches of 2, 2 and 3 rows of unequal length, right-padded.
    scorer = RewardScorer(model, pad_id=3, max_batch_tokens=24)
    got = scorer.score(rows)
    with torch.no_grad():
        alone = [float(model(torch.tensor([r]))[0, -1, 0]) for r in rows]
    assert got == pytest.approx(alone, abs=1e-5)
    assert len(set(round(g, 5) for g in got)) == len(rows)
    with pytest.raises(ValueError, match="no scalar value head"):
        RewardScorer(build_model(get_config("tiny-llama"), device="cpu"))


def test_reward_problems_name_each_input() -> None:
    limits = RewardLimits(max_inputs=3, max_tokens=10, max_model_len=5, vocab_size=50)
    assert reward_problems([[1, 2], [3]], limits) == []
    assert [p.field for p in reward_problems([], limits)] == ["inputs"]
    assert "at most 3 inputs" in reward_problems([[1]] * 4, limits)[0].reason
    problems = reward_problems([[], [1] * 6, [1, 50], [-1]], RewardLimits(9, 99, 5, 50))
    assert [p.field for p in problems] == ["inputs[0]", "inputs[1]", "inputs[2]", "inputs[3]"]
    assert "--max-model-len" in problems[1].reason and "[50]" in problems[2].reason
    assert "--max-score-tokens" in reward_problems([[1] * 5] * 3, limits)[0].reason
