"""The rollout source `meshline train --stage grpo|ppo` hands the Trainer: the engine, colocated.

The training library does not import the engine; this worker-side factory joins them. It builds
`engine.colocated.ColocatedEngine` over the policy module being trained, so rollouts read the
weights the optimizer updates in place (no copy per step) and the KV cache exists only while a
rollout runs.

Under data parallelism the policy is a `replicate`d module whose root forward runs DDP's hooks:
the first call initialises DDP's gradient buckets (inside the engine's inference mode they
would become inference tensors that the backward cannot write) and every call may broadcast
buffers, a collective that ranks generating different numbers of prompts would not match. The
engine therefore runs a view of the policy: a root of its own over the policy's very submodules
(the same Parameter objects and storages, so still no copy), without the hooks.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from engine.colocated import ColocatedEngine, RolloutSampling, colocated_engine
from engine.requests import SequenceResult
from models.transformer import CausalLM, build_model
from training.prompt_data import PromptDataset
from training.rl_sections import RLSection


def hookless_view(policy: CausalLM) -> CausalLM:
    """A `CausalLM` root over `policy`'s submodules (shared, not copied), without the forward
    hooks data parallelism put on `policy` itself."""
    view = build_model(policy.config, device="meta")
    for name, child in policy.named_children():
        setattr(view, name, child)
    ours = dict(view.named_parameters(remove_duplicate=False))
    theirs = dict(policy.named_parameters(remove_duplicate=False))
    if ours.keys() != theirs.keys() or any(ours[k] is not theirs[k] for k in theirs):
        raise ValueError("colocated rollouts: the policy holds parameters outside its submodules")
    if any(b.is_meta for b in view.buffers()):
        raise ValueError("colocated rollouts: the policy holds buffers outside its submodules")
    return view


class PolicyRollouts:
    """The colocated engine over a hook-free view of the policy being trained."""

    def __init__(self, policy: CausalLM, engine: ColocatedEngine) -> None:
        self.policy = policy
        self.engine = engine

    def generate(
        self, model: nn.Module, prompts: Sequence[list[int]], seeds: Sequence[int], n: int
    ) -> list[list[SequenceResult]]:
        """`n` samples per prompt with `model`'s current weights (`model` must be the policy)."""
        if model is not self.policy:
            raise ValueError("colocated rollouts: another module than the policy they run")
        view = self.engine.model
        view.train(model.training)  # the engine restores this mode on the shared submodules
        return self.engine.generate(view, prompts, seeds, n)

    def weight_bytes_copied(self) -> int:
        """Bytes of parameters whose storage moved since the engine was built (0: in place)."""
        return self.engine.weight_bytes_copied()


def colocated_rollouts(policy: nn.Module, prompts: PromptDataset, rl: RLSection) -> PolicyRollouts:
    """The colocated engine over `policy`, sampling as the `rl` section says."""
    if not isinstance(policy, CausalLM):
        raise ValueError(
            f"colocated rollouts run a registry CausalLM; the policy is a {type(policy).__name__}"
        )
    engine = colocated_engine(
        hookless_view(policy),
        prompts.prompts.tokenizer,
        max_model_len=rl.max_prompt_length + rl.max_completion_length,
        sampling=RolloutSampling(
            max_completion_length=rl.max_completion_length,
            temperature=rl.temperature,
            top_p=rl.top_p,
            top_k=rl.top_k,
        ),
    )
    return PolicyRollouts(policy, engine)
