"""GRPO against trl 1.16 on fixed rollouts (same tiny model, ids, old/ref log-probs, advantages).

trl's own `GRPOTrainer._compute_loss` (with its `_get_per_token_logps_and_entropies`) runs on a
minimal stand-in for the trainer instance with a transformers Llama whose weights Meshline's
model loads; loss, KL, clip ratios and every parameter's gradient must agree within 1e-6 (loss)
and 1e-5 (gradients). Prompts share one length (trl left-pads prompts; Meshline's rows start at
position 0, so equal lengths make the two layouts the same sequence).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from trl.trainer.grpo_trainer import GRPOTrainer
from trl.trainer.utils import add_fused_lm_head, nanstd

from models import build_model
from models.hf_adapters import from_hf, hf_config
from models.registry import get_config
from training.objectives.base import ForwardContext
from training.objectives.grpo import GRPOLoss
from training.objectives.rl_losses import group_advantages

CTX = ForwardContext(autocast=contextlib.nullcontext)
N, PROMPT, COMPLETION, G = 6, 4, 7, 3


def _randomise(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            param.copy_((1.0 + 0.2 * noise) if "norm" in name else 0.08 * noise)


def _llama_pair(seed: int):
    config = get_config("tiny-llama")
    hf = LlamaForCausalLM._from_config(
        LlamaConfig(**hf_config(config)), attn_implementation="eager"
    )
    _randomise(hf, seed)
    ours = build_model(config, device="cpu")
    ours.load_state_dict(from_hf(hf.state_dict(), config), strict=True)
    return hf, ours, config


class _Accelerator:
    """accelerate on one process: gathers and reductions are the identity."""

    device = torch.device("cpu")
    num_processes = 1
    sync_gradients = True
    is_main_process = True

    @staticmethod
    def gather(tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    gather_for_metrics = gather

    @staticmethod
    def reduce(tensor: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        return tensor

    @staticmethod
    def autocast():
        return contextlib.nullcontext()


def _rollouts(vocab: int, pad: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    prompt_ids = torch.randint(0, pad, (N, PROMPT), generator=gen)
    completion_ids = torch.randint(0, pad, (N, COMPLETION), generator=gen)
    lengths = torch.tensor([7, 3, 5, 1, 6, 4])
    completion_mask = (torch.arange(COMPLETION)[None] < lengths[:, None]).long()
    completion_ids = completion_ids.masked_fill(completion_mask == 0, pad)
    old = -3.0 - 2.0 * torch.rand((N, COMPLETION), generator=gen)
    ref = -3.0 - 2.0 * torch.rand((N, COMPLETION), generator=gen)
    rewards = torch.tensor([1.0, 0.0, 0.5, 2.0, 2.0, -1.0])
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": torch.ones_like(prompt_ids),
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "old": old,
        "ref": ref,
        "rewards": rewards,
    }


def _trl_loss(hf, rollouts, *, loss_type, beta, epsilon, epsilon_high, advantages):
    add_fused_lm_head(hf, outputs=("log_probs", "entropy"))
    trainer = SimpleNamespace(
        model=hf,
        accelerator=_Accelerator(),
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level="token",
        beta=beta,
        loss_type=loss_type,
        epsilon_low=epsilon,
        epsilon_high=epsilon_high,
        use_vllm=False,
        vllm_importance_sampling_correction=False,
        current_gradient_accumulation_steps=1,
        max_completion_length=COMPLETION,
        _entropy_bonus_enabled=False,
        aux_loss_enabled=False,
        args=SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1),
    )
    trainer._get_per_token_logps_and_entropies = (
        GRPOTrainer._get_per_token_logps_and_entropies.__get__(trainer)
    )
    inputs = {
        "prompt_ids": rollouts["prompt_ids"],
        "prompt_mask": rollouts["prompt_mask"],
        "completion_ids": rollouts["completion_ids"],
        "completion_mask": rollouts["completion_mask"],
        "advantages": advantages,
        "old_per_token_logps": rollouts["old"],
        "ref_per_token_logps": rollouts["ref"],
        "num_items_in_batch": rollouts["completion_mask"].sum(),
    }
    loss = GRPOTrainer._compute_loss(trainer, hf, inputs)
    return loss, {k: v[0] for k, v in trainer._metrics["train"].items()}


def _meshline_batch(rollouts, advantages) -> dict[str, torch.Tensor]:
    ids = torch.cat([rollouts["prompt_ids"], rollouts["completion_ids"]], dim=1)
    mask = torch.cat([torch.zeros_like(rollouts["prompt_ids"]), rollouts["completion_mask"]], 1)
    shifted = torch.zeros((N, PROMPT + COMPLETION - 1))
    old, ref = shifted.clone(), shifted.clone()
    old[:, PROMPT - 1 :] = rollouts["old"]
    ref[:, PROMPT - 1 :] = rollouts["ref"]
    return {
        "input_ids": ids,
        "completion_mask": mask,
        "advantages": advantages,
        "old_logps": old,
        "ref_logps": ref,
        "rewards": rollouts["rewards"],
    }


CASES = [
    ("grpo", 0.04, 0.2, 0.2),
    ("grpo", 0.0, 0.2, 0.28),
    ("bnpo", 0.1, 0.2, 0.2),
    ("dr_grpo", 0.04, 0.1, 0.3),
    ("dapo", 0.02, 0.2, 0.28),
]


@pytest.mark.parametrize(("loss_type", "beta", "epsilon", "epsilon_high"), CASES)
def test_grpo_loss_metrics_and_gradients_equal_trl(loss_type, beta, epsilon, epsilon_high) -> None:
    hf, ours, config = _llama_pair(seed=0)
    rollouts = _rollouts(config.vocab_size, pad=config.vocab_size - 1)
    advantages = group_advantages(rollouts["rewards"], G, "group")
    hf.train()
    trl_loss, trl_metrics = _trl_loss(
        hf,
        rollouts,
        loss_type=loss_type,
        beta=beta,
        epsilon=epsilon,
        epsilon_high=epsilon_high,
        advantages=advantages,
    )
    trl_loss.backward()

    objective = GRPOLoss(
        num_generations=G,
        beta=beta,
        epsilon=epsilon,
        epsilon_high=epsilon_high,
        loss_type=loss_type,
        max_completion_length=COMPLETION,
    )
    batch = _meshline_batch(rollouts, advantages)
    ours.train()
    out = objective.compute(ours, batch, CTX)
    count = objective.count(batch)
    (out.loss_sum / count).backward()
    assert abs(out.loss_sum.item() / count - trl_loss.item()) <= 1e-6
    logged = objective.summarize(out.metrics)
    for name in ("clip_ratio/low", "clip_ratio/high", "clip_ratio/region"):
        assert abs(logged[name] - trl_metrics[f"{name}_mean"]) <= 1e-6, name
    assert logged["clip_ratio/region"] > 0  # the old log-probs are far: some tokens clip
    if beta:
        assert abs(logged["kl"] - trl_metrics["kl"]) <= 1e-6
    expected = from_hf({name: p.grad for name, p in hf.named_parameters()}, config)
    grads = {name: p.grad for name, p in ours.named_parameters() if p.grad is not None}
    assert set(grads) == set(expected)
    for name, grad in grads.items():
        assert (grad - expected[name]).abs().max().item() <= 1e-5, name
    assert max(g.abs().max().item() for g in grads.values()) > 1e-4


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_are_trls(scale) -> None:
    """trl's normalisation (its `nanstd`, unbiased; + 1e-4), per group or over the batch."""
    rewards = torch.tensor([1.0, 0.0, 0.5, 2.0, 2.0, 2.0, -1.0, 3.0, 0.25])
    grouped = rewards.view(-1, 3)
    mean = grouped.mean(1).repeat_interleave(3)
    std = nanstd(grouped, dim=1).repeat_interleave(3) if scale == "group" else nanstd(rewards)
    expected = rewards - mean if scale == "none" else (rewards - mean) / (std + 1e-4)
    assert torch.allclose(group_advantages(rewards, 3, scale), expected, atol=1e-6, rtol=0)
    assert group_advantages(rewards, 3, "group")[3:6].abs().max() == 0  # equal rewards: none


def test_grpo_settings_are_refused_by_name() -> None:
    for kwargs, flag in (
        ({"loss_type": "sapo"}, "--loss-type"),
        ({"scale_rewards": "max"}, "--scale-rewards"),
        ({"num_generations": 1}, "--num-generations"),
        ({"beta": -0.1}, "--beta"),
        ({"epsilon": 0.0}, "--epsilon"),
    ):
        with pytest.raises(ValueError, match=flag):
            GRPOLoss(**kwargs)
