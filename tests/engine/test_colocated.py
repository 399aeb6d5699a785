"""Colocated rollouts: the engine runs the module being trained and reads its weights in place.

After optimizer steps, the engine's greedy completions equal a greedy loop over the module's own
forward (the reference); no parameter storage moves (0 bytes copied); the KV cache exists only
while a rollout runs.
"""

from __future__ import annotations

import pytest
import torch

from engine.colocated import ColocatedEngine, RolloutSampling
from engine.tokens import TokenizerInfo
from models import build_model
from models.registry import get_config

PROMPTS = [[1, 2, 3], [4, 5], [9, 8, 7, 6]]


def _model():
    config = get_config("tiny-llama")
    model = build_model(config, device="cpu")
    model.init_weights(seed=0)
    return model, config


@torch.no_grad()
def _greedy_reference(model, prompt: list[int], new: int) -> list[int]:
    ids = list(prompt)
    for _ in range(new):
        logits = model(torch.tensor([ids]))
        ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt) :]


def _train_steps(model, steps: int) -> None:
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3)
    gen = torch.Generator().manual_seed(1)
    model.train()
    for _ in range(steps):
        ids = torch.randint(0, 200, (2, 12), generator=gen)
        logits = model(ids)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.parametrize("decode_step", ["auto", "module"])
def test_rollouts_read_the_trained_weights_in_place(decode_step) -> None:
    from engine.config import EngineConfig

    model, config = _model()
    colocated = ColocatedEngine(
        model,
        TokenizerInfo(config.vocab_size),
        EngineConfig(cpu_linear="dense", decode_step=decode_step),
        RolloutSampling(max_completion_length=6, temperature=0.0),
    )
    before = [g[0].token_ids for g in colocated.generate(model, PROMPTS, [0, 0, 0], 1)]
    assert before == [_greedy_reference(model, p, 6) for p in PROMPTS]
    _train_steps(model, 3)
    assert colocated.weight_bytes_copied() == 0
    after = [g[0].token_ids for g in colocated.generate(model, PROMPTS, [0, 0, 0], 1)]
    assert after == [_greedy_reference(model, p, 6) for p in PROMPTS]
    assert after != before  # the steps changed what the engine generates
    assert model.training  # the rollout leaves the module's mode as it was


def test_the_kv_cache_lives_only_during_a_rollout() -> None:
    model, config = _model()
    colocated = ColocatedEngine(
        model, TokenizerInfo(config.vocab_size), sampling=RolloutSampling(max_completion_length=8)
    )
    asleep = colocated.kv_cache_bytes()
    colocated.wake()
    awake = colocated.kv_cache_bytes()
    colocated.sleep()
    assert asleep <= 4096 < awake
    assert colocated.kv_cache_bytes() == asleep
    groups = colocated.generate(model, PROMPTS, [3, 4, 5], 4)
    assert [len(g) for g in groups] == [4, 4, 4]
    assert colocated.kv_cache_bytes() == asleep
    again = colocated.generate(model, PROMPTS, [3, 4, 5], 4)  # same seeds, same samples
    assert [[s.token_ids for s in g] for g in again] == [[s.token_ids for s in g] for g in groups]
    assert len({tuple(s.token_ids) for s in groups[0]}) > 1  # the group's samples differ


def test_a_replaced_parameter_storage_is_refused() -> None:
    model, config = _model()
    colocated = ColocatedEngine(model, TokenizerInfo(config.vocab_size))
    weight = model.lm_head.weight if model.lm_head is not None else None
    assert weight is not None
    weight.data = weight.data.clone()
    assert colocated.weight_bytes_copied() == weight.numel() * weight.element_size()
    with pytest.raises(RuntimeError, match="in place"):
        colocated.generate(model, PROMPTS, [0, 0, 0], 2)


def test_a_packed_layout_is_refused() -> None:
    from engine.config import EngineConfig

    model, config = _model()
    with pytest.raises(ValueError, match="--cpu-linear must be dense"):
        ColocatedEngine(model, TokenizerInfo(config.vocab_size), EngineConfig(cpu_linear="packed"))


@torch.no_grad()
def _sampled_reference(model, prompt: list[int], seed: int, new: int) -> list[int]:
    """A loop over the module's forward, drawing as the engine does (one generator a sample)."""
    from engine.sampling import sample_rows

    gen = torch.Generator().manual_seed(seed)
    ids = list(prompt)
    for _ in range(new):
        logits = model(torch.tensor([ids]))[0, -1:]
        ids.append(int(sample_rows(logits, [gen])[0]))
    return ids[len(prompt) :]


def test_group_rollouts_run_in_c_over_the_trained_weights() -> None:
    """24 rows a step (3 groups of 8, past the C step's 8-row bound of packed layouts) run in C
    on the dense weights; each group's prompt is prefilled once; after training steps every
    sample equals a sampled loop over the module's own forward with the sample's seed."""
    from engine.native_step import NativeStep, available

    if not available()[0]:
        pytest.skip(available()[1])
    model, config = _model()
    colocated = ColocatedEngine(
        model, TokenizerInfo(config.vocab_size), sampling=RolloutSampling(max_completion_length=5)
    )
    step = colocated.engine.runner.decode_step
    assert isinstance(step, NativeStep) and step.max_rows >= 24
    _train_steps(model, 2)
    prefilled: list[int] = []
    real_prefill = colocated.engine.runner.prefill

    def counting_prefill(prompts, *args, **kwargs):
        prefilled.append(len(prompts))
        return real_prefill(prompts, *args, **kwargs)

    colocated.engine.runner.prefill = counting_prefill
    groups = colocated.generate(model, PROMPTS, [10, 20, 30], 8)
    assert sum(prefilled) == len(PROMPTS)  # one prompt row per group, copied to its samples
    assert colocated.weight_bytes_copied() == 0
    model.eval()
    for prompt, seed, group in zip(PROMPTS, [10, 20, 30], groups, strict=True):
        assert [s.token_ids for s in group] == [
            _sampled_reference(model, prompt, seed + j, 5) for j in range(8)
        ]
