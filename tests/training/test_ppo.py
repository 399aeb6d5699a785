"""PPO on fixed rollouts against the equations of DeepSpeed-Chat's step 3 and trl's PPOTrainer.

trl 1.16 no longer ships a PPO trainer (trl 0.19's `PPOTrainer.train` computed it inline), so the
reference here is those equations written element by element, one sequence and one token at a
time: DeepSpeed-Chat's `compute_rewards` (k1 KL penalty per action, the score on the last one),
`get_advantages_and_returns` (GAE from the sequence's end), trl's whitening, clipped policy loss
and ½ max of clipped / unclipped squared value error. The objective must equal them within 1e-6.
"""

from __future__ import annotations

import contextlib
import copy
import math

import pytest
import torch

from models import build_model
from models.registry import get_config
from training.objectives.base import ForwardContext
from training.objectives.ppo import PolicyAndCritic, PPOLoss, token_rewards
from training.objectives.rl_losses import gae, masked_whiten, token_logps

CTX = ForwardContext(autocast=contextlib.nullcontext)
PROMPT, COMPLETION = 3, 6
LENGTHS = [6, 2, 4, 1]


def _reference_rewards(scores, old, ref, starts, ends, kl_coef):
    rows = []
    for i in range(len(scores)):
        row = [0.0] * old.shape[1]
        for t in range(starts[i], ends[i]):
            row[t] = -kl_coef * float(old[i, t] - ref[i, t])
        row[ends[i] - 1] += float(scores[i])
        rows.append(row)
    return rows


def _reference_gae(rewards, values, starts, ends, gamma, lam):
    advantages, returns = [], []
    for i in range(len(rewards)):
        adv = [0.0] * len(rewards[i])
        last = 0.0
        for t in reversed(range(starts[i], ends[i])):
            next_value = float(values[i][t + 1]) if t + 1 < ends[i] else 0.0
            delta = rewards[i][t] + gamma * next_value - float(values[i][t])
            last = delta + gamma * lam * last
            adv[t] = last
        advantages.append(adv)
        returns.append([a + float(v) for a, v in zip(adv, values[i], strict=True)])
    return advantages, returns


def _reference_whiten(advantages, starts, ends):
    flat = [advantages[i][t] for i in range(len(advantages)) for t in range(starts[i], ends[i])]
    mean = sum(flat) / len(flat)
    var = sum((x - mean) ** 2 for x in flat) / (len(flat) - 1)
    return [[(a - mean) / math.sqrt(var + 1e-8) for a in row] for row in advantages]


def _model_pair(seed: int):
    config = get_config("tiny-llama")
    policy = build_model(config, device="cpu")
    policy.init_weights(seed=seed)
    return PPOLoss(seed=seed).prepare_model(policy)


def _rollout(vocab: int):
    gen = torch.Generator().manual_seed(5)
    n, width = len(LENGTHS), PROMPT + COMPLETION
    ids = torch.randint(0, vocab, (n, width), generator=gen)
    mask = torch.zeros((n, width), dtype=torch.long)
    for i, length in enumerate(LENGTHS):
        mask[i, PROMPT : PROMPT + length] = 1
    return {
        "input_ids": ids,
        "completion_mask": mask,
        "old_logps": -4.0 - torch.rand((n, width - 1), generator=gen),
        "ref_logps": -4.0 - torch.rand((n, width - 1), generator=gen),
        "old_values": torch.randn((n, width - 1), generator=gen),
        "scores": torch.tensor([1.5, -0.5, 0.25, 2.0]),
    }


def test_rewards_and_gae_follow_deepspeed_chat() -> None:
    batch = _rollout(200)
    mask = batch["completion_mask"][:, 1:].float()
    starts = [PROMPT - 1] * len(LENGTHS)
    ends = [PROMPT - 1 + n for n in LENGTHS]
    rewards = token_rewards(batch["scores"], batch["old_logps"], batch["ref_logps"], mask, 0.1)
    expected = _reference_rewards(
        batch["scores"], batch["old_logps"], batch["ref_logps"], starts, ends, 0.1
    )
    assert torch.allclose(rewards, torch.tensor(expected), atol=1e-6, rtol=0)
    values = batch["old_values"] * mask
    advantages, returns = gae(rewards, values, 0.9, 0.8)
    ref_adv, ref_ret = _reference_gae(expected, values.tolist(), starts, ends, 0.9, 0.8)
    assert torch.allclose(advantages * mask, torch.tensor(ref_adv), atol=1e-6, rtol=0)
    assert torch.allclose(returns * mask, torch.tensor(ref_ret) * mask, atol=1e-6, rtol=0)
    whitened = masked_whiten(advantages, mask)
    ref_white = _reference_whiten(ref_adv, starts, ends)
    assert torch.allclose(whitened * mask, torch.tensor(ref_white) * mask, atol=1e-5, rtol=0)


@pytest.mark.parametrize(("cliprange", "cliprange_value"), [(0.2, 0.2), (0.05, 0.5)])
def test_ppo_loss_equals_the_equations(cliprange, cliprange_value) -> None:
    model = _model_pair(seed=0)
    batch = _rollout(model.policy.config.vocab_size)
    objective = PPOLoss(
        kl_coef=0.1, gamma=0.9, lam=0.8, cliprange=cliprange,
        cliprange_value=cliprange_value, vf_coef=0.3, reference=copy.deepcopy(model.policy),
    )  # fmt: skip
    out = objective.compute(model, batch, CTX)
    out.loss_sum.backward()

    ids = batch["input_ids"]
    with torch.no_grad():
        logps = token_logps(model.policy(ids), ids)
        values = model.critic(ids)[..., 0][:, :-1]
    starts = [PROMPT - 1] * len(LENGTHS)
    ends = [PROMPT - 1 + n for n in LENGTHS]
    rewards = _reference_rewards(
        batch["scores"], batch["old_logps"], batch["ref_logps"], starts, ends, 0.1
    )
    old_values = (batch["old_values"] * batch["completion_mask"][:, 1:]).tolist()
    adv, ret = _reference_gae(rewards, old_values, starts, ends, 0.9, 0.8)
    adv = _reference_whiten(adv, starts, ends)
    policy_terms, value_terms, clipped = [], [], 0
    for i in range(len(LENGTHS)):
        for t in range(starts[i], ends[i]):
            ratio = math.exp(float(logps[i, t] - batch["old_logps"][i, t]))
            unclipped = -adv[i][t] * ratio
            clip = -adv[i][t] * min(max(ratio, 1 - cliprange), 1 + cliprange)
            policy_terms.append(max(unclipped, clip))
            clipped += clip > unclipped
            v, v_old = float(values[i, t]), old_values[i][t]
            v_clip = min(max(v, v_old - cliprange_value), v_old + cliprange_value)
            value_terms.append(max((v - ret[i][t]) ** 2, (v_clip - ret[i][t]) ** 2))
    policy_loss = sum(policy_terms) / len(policy_terms)
    value_loss = 0.5 * sum(value_terms) / len(value_terms)
    assert abs(out.metrics["loss/policy"] - policy_loss) <= 1e-6
    assert abs(out.metrics["loss/value"] - value_loss) <= 1e-6
    assert abs(out.loss_sum.item() - (policy_loss + 0.3 * value_loss)) <= 1e-6
    assert out.metrics["policy/clipfrac"] == pytest.approx(clipped / len(policy_terms))
    assert objective.count(batch) == 1.0
    policy_grads = [p.grad for p in model.policy.parameters() if p.grad is not None]
    critic_grads = [p.grad for p in model.critic.parameters() if p.grad is not None]
    assert policy_grads and critic_grads  # both are trained
    assert model.critic.lm_head.out_features == 1


def test_ppo_settings_are_refused_by_name() -> None:
    for kwargs, flag in (
        ({"gamma": 1.5}, "--gamma"),
        ({"lam": -0.1}, "--lam"),
        ({"cliprange": 0.0}, "--cliprange"),
        ({"kl_coef": -1.0}, "--kl-coef"),
        ({"reward_clip": 0.0}, "--reward-clip"),
    ):
        with pytest.raises(ValueError, match=flag):
            PPOLoss(**kwargs)
    with pytest.raises(ValueError, match="value head"):
        config = get_config("tiny-llama")
        PolicyAndCritic(build_model(config, device="cpu"), build_model(config, device="cpu"))
