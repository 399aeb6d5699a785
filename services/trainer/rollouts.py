"""The rollout source `meshline train --stage grpo|ppo` hands the Trainer: the engine, colocated.

The training library does not import the engine; this worker-side factory joins them. It builds
`engine.colocated.ColocatedEngine` over the policy module being trained, so rollouts read the
weights the optimizer updates in place (no copy per step) and the KV cache exists only while a
rollout runs.
"""

from __future__ import annotations

from torch import nn

from engine.colocated import ColocatedEngine, RolloutSampling, colocated_engine
from training.prompt_data import PromptDataset
from training.rl_sections import RLSection


def colocated_rollouts(policy: nn.Module, prompts: PromptDataset, rl: RLSection) -> ColocatedEngine:
    """The colocated engine over `policy`, sampling as the `rl` section says."""
    from models.transformer import CausalLM

    if not isinstance(policy, CausalLM):
        raise ValueError(
            f"colocated rollouts run a registry CausalLM; the policy is a {type(policy).__name__}"
        )
    return colocated_engine(
        policy,
        prompts.prompts.tokenizer,
        max_model_len=rl.max_prompt_length + rl.max_completion_length,
        sampling=RolloutSampling(
            max_completion_length=rl.max_completion_length,
            temperature=rl.temperature,
            top_p=rl.top_p,
            top_k=rl.top_k,
        ),
    )
