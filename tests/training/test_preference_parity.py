"""The preference objectives against trl 1.16, on the same tiny model, tokens and batch (fp32, CPU).

trl's own loss code runs: `DPOTrainer._compute_loss` and `RewardTrainer.compute_loss`, called on a
minimal stand-in for the trainer instance (the attributes those methods read; no dataset, no
accelerate launch) with a transformers Llama whose weights Meshline's model loads through
`from_hf`. Loss, logged rewards and every parameter's gradient must agree within 1e-5.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification
from trl.trainer.dpo_trainer import DPOTrainer
from trl.trainer.reward_trainer import RewardTrainer
from trl.trainer.utils import add_fused_lm_head

from models import build_model
from models.hf_adapters import from_hf, hf_config, to_hf
from models.registry import get_config
from models.value_head import attach_value_head
from training.objectives.base import ForwardContext
from training.objectives.dpo import DPOLoss
from training.objectives.rm import RewardLoss

ATOL = 1e-5
PAIRS, SEQ = 3, 14
CTX = ForwardContext(autocast=contextlib.nullcontext)


def _randomise(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            param.copy_((1.0 + 0.2 * noise) if "norm" in name else 0.08 * noise)


def _llama_pair(seed: int):
    """(transformers LlamaForCausalLM, Meshline model with its weights, config)."""
    config = get_config("tiny-llama")
    hf = LlamaForCausalLM._from_config(
        LlamaConfig(**hf_config(config)), attn_implementation="eager"
    )
    _randomise(hf, seed)
    ours = build_model(config, device="cpu")
    ours.load_state_dict(from_hf(hf.state_dict(), config), strict=True)
    return hf, ours, config


def _pairwise_batch(vocab: int, pad: int) -> dict[str, torch.Tensor]:
    """Pairs sharing a prompt, responses of different lengths, right-padded with `pad`."""
    gen = torch.Generator().manual_seed(7)
    batch: dict[str, list[torch.Tensor]] = defaultdict(list)
    for prompt_len, chosen_len, rejected_len in ((3, 5, 8), (6, 7, 2), (4, 10, 10)):
        prompt = torch.randint(0, pad, (prompt_len,), generator=gen)
        for side, length in (("chosen", chosen_len), ("rejected", rejected_len)):
            response = torch.randint(0, pad, (length,), generator=gen)
            ids = torch.full((SEQ,), pad)
            ids[: prompt_len + length] = torch.cat([prompt, response])
            loss_mask = torch.zeros(SEQ, dtype=torch.long)
            loss_mask[prompt_len : prompt_len + length] = 1
            attention = torch.zeros(SEQ, dtype=torch.long)
            attention[: prompt_len + length] = 1
            batch[f"{side}_input_ids"].append(ids)
            batch[f"{side}_loss_mask"].append(loss_mask)
            batch[f"{side}_attention_mask"].append(attention)
    return {key: torch.stack(rows) for key, rows in batch.items()}


class _Accelerator:
    """What trl's loss code asks of accelerate on one process: gathers are the identity."""

    device = torch.device("cpu")

    @staticmethod
    def gather(tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    gather_for_metrics = gather


def _trl_instance(model: torch.nn.Module, **attributes) -> SimpleNamespace:
    return SimpleNamespace(
        model=model,
        accelerator=_Accelerator(),
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
        **attributes,
    )


def _trl_dpo(hf, hf_ref, batch, *, loss_type: str, beta: float, label_smoothing: float):
    """trl's DPO loss and metrics on `batch` (its layout: chosen rows then rejected rows)."""
    for model in (hf, hf_ref):
        add_fused_lm_head(model, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
    trainer = _trl_instance(
        hf,
        ref_model=hf_ref,
        aux_loss_enabled=False,
        ld_alpha=None,
        precompute_ref_logps=False,
        f_divergence_type="reverse_kl",
        loss_types=[loss_type],
        loss_weights=[1.0],
        beta=beta,
        label_smoothing=label_smoothing,
        use_weighting=False,
        args=SimpleNamespace(gradient_checkpointing_kwargs=None),
    )
    inputs = {
        key: torch.cat([batch[f"chosen_{name}"], batch[f"rejected_{name}"]])
        for key, name in (
            ("input_ids", "input_ids"),
            ("attention_mask", "attention_mask"),
            ("completion_mask", "loss_mask"),
        )
    }
    loss = DPOTrainer._compute_loss(trainer, hf, inputs, False)
    return loss, {name: values[0] for name, values in trainer._metrics["train"].items()}


def _meshline_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


CASES = [
    ("sigmoid", 0.1, 0.0),
    ("sigmoid", 0.5, 0.0),
    ("hinge", 0.3, 0.0),
    ("ipo", 0.2, 0.0),
    ("robust", 0.1, 0.2),
]


@pytest.mark.parametrize(("loss_type", "beta", "label_smoothing"), CASES)
def test_dpo_loss_rewards_and_gradients_equal_trl(loss_type, beta, label_smoothing) -> None:
    hf, ours, config = _llama_pair(seed=0)
    hf_ref, ours_ref, _ = _llama_pair(seed=1)  # a reference unlike the policy: rewards non-zero
    batch = _pairwise_batch(config.vocab_size, pad=config.vocab_size - 1)
    hf.train()
    trl_loss, trl_metrics = _trl_dpo(
        hf, hf_ref, batch, loss_type=loss_type, beta=beta, label_smoothing=label_smoothing
    )
    trl_loss.backward()

    objective = DPOLoss(
        beta=beta, loss_type=loss_type, label_smoothing=label_smoothing, reference=ours_ref
    )
    ours.train()
    out = objective.compute(ours, batch, CTX)
    pairs = objective.count(batch)
    (out.loss_sum / pairs).backward()

    assert abs(out.loss_sum.item() / pairs - trl_loss.item()) <= ATOL
    for name in (
        "rewards/chosen",
        "rewards/rejected",
        "rewards/accuracies",
        "rewards/margins",
        "logps/chosen",
        "logps/rejected",
    ):
        assert abs(out.metrics[name] / pairs - trl_metrics[name]) <= ATOL, name
    assert trl_metrics["rewards/margins"] != 0.0
    hf_grads = {name: p.grad for name, p in hf.named_parameters()}
    expected = from_hf(hf_grads, config)
    ours_grads = _meshline_grads(ours)
    assert set(ours_grads) == set(expected)
    for name, grad in ours_grads.items():
        assert (grad - expected[name]).abs().max().item() <= ATOL, name
    assert max(g.abs().max().item() for g in ours_grads.values()) > 1e-4  # not all zero


def test_dpo_first_step_loss_is_ln2_when_the_policy_is_the_reference() -> None:
    _, ours, config = _llama_pair(seed=0)
    batch = _pairwise_batch(config.vocab_size, pad=config.vocab_size - 1)
    objective = DPOLoss(beta=0.1, reference=copy.deepcopy(ours))
    out = objective.compute(ours, batch, CTX)
    assert abs(out.loss_sum.item() / objective.count(batch) - math.log(2)) <= 1e-6
    assert abs(out.metrics["rewards/margins"]) <= 1e-5  # equal up to fp32 summation order


def test_dpo_with_precomputed_reference_logps_equals_the_reference_model() -> None:
    _, ours, config = _llama_pair(seed=0)
    _, ours_ref, _ = _llama_pair(seed=1)
    batch = _pairwise_batch(config.vocab_size, pad=config.vocab_size - 1)
    live = DPOLoss(beta=0.1, reference=ours_ref).compute(ours, batch, CTX)
    scored = dict(batch)  # the reference pass the loop runs before a step's forwards
    DPOLoss(beta=0.1, reference=ours_ref).prepare_step(ours, [scored], CTX)
    assert set(scored) - set(batch) == {"ref_chosen_logps", "ref_rejected_logps"}
    precomputed = DPOLoss(beta=0.1).compute(ours, scored, CTX)
    assert precomputed.loss_sum.item() == pytest.approx(live.loss_sum.item(), abs=1e-6)
    with pytest.raises(ValueError, match="needs a reference"):
        DPOLoss(beta=0.1).compute(ours, batch, CTX)


def _reward_pair(config, seed: int):
    """(transformers LlamaForSequenceClassification, Meshline model with a value head), same weights."""
    ours = attach_value_head(build_model(config, device="cpu"), seed=seed)
    _randomise(ours, seed)
    pad = config.vocab_size - 1
    hf_cfg = LlamaConfig(**hf_config(config), num_labels=1, pad_token_id=pad)
    hf = LlamaForSequenceClassification._from_config(hf_cfg, attn_implementation="eager")
    state = to_hf(ours.state_dict(), config)
    state["score.weight"] = state.pop("lm_head.weight")
    hf.load_state_dict(state, strict=True)
    return hf, ours


@pytest.mark.parametrize("margin", [False, True])
def test_reward_loss_accuracy_and_gradients_equal_trl(margin) -> None:
    config = get_config("tiny-llama")
    hf, ours = _reward_pair(config, seed=3)
    batch = _pairwise_batch(config.vocab_size, pad=config.vocab_size - 1)
    trainer = _trl_instance(hf, args=SimpleNamespace(center_rewards_coefficient=None))
    inputs = {
        "input_ids": torch.cat([batch["chosen_input_ids"], batch["rejected_input_ids"]]),
        "attention_mask": torch.cat(
            [batch["chosen_attention_mask"], batch["rejected_attention_mask"]]
        ),
    }
    if margin:
        batch["margin"] = inputs["margin"] = torch.tensor([0.5, -0.25, 1.0])
    hf.train()
    trl_loss = RewardTrainer.compute_loss(trainer, hf, inputs)
    trl_loss.backward()
    trl_metrics = {name: values[0] for name, values in trainer._metrics["train"].items()}

    objective = RewardLoss()
    ours.train()
    out = objective.compute(ours, batch, CTX)
    pairs = objective.count(batch)
    (out.loss_sum / pairs).backward()
    assert abs(out.loss_sum.item() / pairs - trl_loss.item()) <= ATOL
    assert abs(out.metrics["accuracy"] / pairs - trl_metrics["accuracy"]) <= ATOL
    assert abs(out.metrics["margin"] / pairs - trl_metrics["margin"]) <= ATOL
    assert trl_metrics["margin"] != 0.0
    hf_grads = {name: p.grad for name, p in hf.named_parameters()}
    hf_grads["lm_head.weight"] = hf_grads.pop("score.weight")
    expected = from_hf(hf_grads, config)
    ours_grads = _meshline_grads(ours)
    assert set(ours_grads) == set(expected)
    for name, grad in ours_grads.items():
        assert (grad - expected[name]).abs().max().item() <= ATOL, name


def test_reward_loss_refuses_a_model_without_a_value_head() -> None:
    config = get_config("tiny-llama")
    batch = _pairwise_batch(config.vocab_size, pad=config.vocab_size - 1)
    with pytest.raises(ValueError, match="scalar value head"):
        RewardLoss().compute(build_model(config, device="cpu"), batch, CTX)


def test_sigmoid_label_smoothing_is_conservative_dpo() -> None:
    """trl 1.16's `sigmoid` has no smoothing; Meshline's is cDPO's (MindSpeed-LLM's), which at 0
    is trl's and otherwise mixes in the flipped label."""
    from training.objectives.preference_losses import dpo_loss

    chosen, rejected = torch.tensor([-4.0, -9.0]), torch.tensor([-6.0, -5.0])
    ref_chosen, ref_rejected = torch.tensor([-5.0, -7.0]), torch.tensor([-5.5, -6.0])
    h = (chosen - ref_chosen) - (rejected - ref_rejected)
    terms = dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta=0.3, label_smoothing=0.1)
    expected = -0.9 * torch.nn.functional.logsigmoid(
        0.3 * h
    ) - 0.1 * torch.nn.functional.logsigmoid(-0.3 * h)
    assert torch.allclose(terms.losses, expected, atol=1e-7)
    with pytest.raises(ValueError, match="needs chosen_tokens"):
        dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta=0.3, loss_type="ipo")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"loss_type": "kto"}, "--dpo-loss-type 'kto'"),
        ({"beta": 0.0}, "--dpo-beta must be > 0"),
        ({"label_smoothing": 0.5}, r"--dpo-label-smoothing must be in \[0, 0.5\)"),
        ({"loss_type": "hinge", "label_smoothing": 0.1}, "no effect on --dpo-loss-type hinge"),
    ],
)
def test_dpo_settings_are_refused_by_flag(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        DPOLoss(**kwargs)


def test_simpo_loss_rewards_and_gradients_equal_trl_cpo_trainer() -> None:
    """SimPO against trl's CPOTrainer (loss_type="simpo", no NLL term): its averaged log-probs on
    the transformers model, its `cpo_loss`, and the gradients through both."""
    from trl.experimental.cpo.cpo_trainer import CPOTrainer

    from training.objectives.simpo import SimPOLoss

    hf, ours, config = _llama_pair(seed=0)
    batch = _pairwise_batch(config.vocab_size, pad=config.vocab_size - 1)
    beta, ratio = 2.0, 0.5
    ids = torch.cat([batch["chosen_input_ids"], batch["rejected_input_ids"]])
    mask = torch.cat([batch["chosen_loss_mask"], batch["rejected_loss_mask"]])
    attention = torch.cat([batch["chosen_attention_mask"], batch["rejected_attention_mask"]])
    logits = hf(input_ids=ids, attention_mask=attention).logits
    avg = CPOTrainer.get_batch_logps(logits, ids.masked_fill(mask == 0, -100), True)
    trainer = SimpleNamespace(
        alpha=0.0,
        loss_type="simpo",
        beta=beta,
        simpo_gamma=ratio * beta,
        label_smoothing=0.0,
        accelerator=_Accelerator(),
    )
    losses, chosen_rewards, rejected_rewards = CPOTrainer.cpo_loss(trainer, *avg.chunk(2))
    losses.mean().backward()

    objective = SimPOLoss(beta=beta, gamma_beta_ratio=ratio)
    out = objective.compute(ours, batch, CTX)
    pairs = objective.count(batch)
    (out.loss_sum / pairs).backward()
    assert abs(out.loss_sum.item() / pairs - losses.mean().item()) <= ATOL
    assert abs(out.metrics["rewards/chosen"] / pairs - chosen_rewards.mean().item()) <= ATOL
    assert abs(out.metrics["rewards/rejected"] / pairs - rejected_rewards.mean().item()) <= ATOL
    expected = from_hf({name: p.grad for name, p in hf.named_parameters()}, config)
    for name, param in ours.named_parameters():
        assert (param.grad - expected[name]).abs().max().item() <= ATOL, name


def _trl_orpo(hf, batch, beta: float):
    """trl's ORPO loss and metrics: its `get_batch_loss_metrics` (concatenated forward, NLL over
    the chosen sequences, `odds_ratio_loss`) on a stand-in for the trainer instance."""
    from trl.experimental.orpo.orpo_trainer import ORPOTrainer

    trainer = SimpleNamespace(
        beta=beta,
        is_encoder_decoder=False,
        padding_value=0,
        aux_loss_enabled=False,
        accelerator=_Accelerator(),
        concatenated_inputs=ORPOTrainer.concatenated_inputs,
        get_batch_logps=ORPOTrainer.get_batch_logps,
    )
    trainer.concatenated_forward = lambda model, inputs: ORPOTrainer.concatenated_forward(
        trainer, model, inputs
    )
    trainer.odds_ratio_loss = lambda c, r: ORPOTrainer.odds_ratio_loss(trainer, c, r)
    inputs = {}
    for side in ("chosen", "rejected"):
        inputs[f"{side}_input_ids"] = batch[f"{side}_input_ids"]
        inputs[f"{side}_attention_mask"] = batch[f"{side}_attention_mask"]
        labels = batch[f"{side}_input_ids"].masked_fill(batch[f"{side}_loss_mask"] == 0, -100)
        inputs[f"{side}_labels"] = labels
    return ORPOTrainer.get_batch_loss_metrics(trainer, hf, inputs)


def test_orpo_loss_metrics_and_gradients_equal_trl_orpo_trainer() -> None:
    from training.objectives.orpo import ORPOLoss

    hf, ours, config = _llama_pair(seed=0)
    batch = _pairwise_batch(config.vocab_size, pad=config.vocab_size - 1)
    beta = 0.25
    hf.train()
    trl_loss, trl_metrics = _trl_orpo(hf, batch, beta)
    trl_loss.backward()

    objective = ORPOLoss(beta=beta)
    ours.train()
    out = objective.compute(ours, batch, CTX)
    pairs = objective.count(batch)
    (out.loss_sum / pairs).backward()
    assert abs(out.loss_sum.item() / pairs - trl_loss.item()) <= ATOL
    logged = objective.summarize(out.metrics)
    for name in (
        "rewards/chosen",
        "rewards/rejected",
        "rewards/accuracies",
        "rewards/margins",
        "logps/chosen",
        "logps/rejected",
        "nll_loss",
        "log_odds_ratio",
        "log_odds_chosen",
    ):
        assert abs(logged[name] - trl_metrics[name]) <= ATOL, name
    assert trl_metrics["log_odds_chosen"] != 0.0
    expected = from_hf({name: p.grad for name, p in hf.named_parameters()}, config)
    for name, param in ours.named_parameters():
        assert (param.grad - expected[name]).abs().max().item() <= ATOL, name


def test_orpo_odds_ratio_is_the_papers_formula() -> None:
    """log odds(y) = log p − log(1 − p) with p = exp(avg log-prob), checked in float64 by hand."""
    from training.objectives.preference_losses import orpo_odds_ratio

    chosen = torch.tensor([-0.2, -1.5, -3.0], dtype=torch.float64)
    rejected = torch.tensor([-0.9, -0.4, -3.5], dtype=torch.float64)
    terms, _, log_odds = orpo_odds_ratio(chosen, rejected, beta=0.5)

    def odds(x):
        return torch.log(torch.exp(x) / (1 - torch.exp(x)))

    expected = odds(chosen.float()) - odds(rejected.float())
    assert torch.allclose(log_odds, expected, atol=1e-5)
    assert torch.allclose(terms.losses, -0.5 * torch.nn.functional.logsigmoid(expected), atol=1e-5)
