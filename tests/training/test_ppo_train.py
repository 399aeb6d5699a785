"""--stage ppo end to end: colocated rollouts, the reward, policy and critic trained together."""

from __future__ import annotations

import copy

import pytest
import torch

from services.trainer.arguments import parse_args
from services.trainer.rollouts import colocated_rollouts
from tests.training.test_grpo_train import _flags, digit_task  # noqa: F401  (a fixture)
from training.launch_checks import check_paths
from training.loop import Trainer
from training.objectives.ppo import PolicyAndCritic, PPOLoss


def _ppo_flags(task, *extra: str) -> list[str]:
    flags = _flags(task, *extra)
    for flag in ("--num-generations", "--loss-type"):
        at = flags.index(flag)
        del flags[at : at + 2]
    flags[flags.index("grpo")] = "ppo"
    return flags


def test_ppo_trains_policy_and_critic_on_its_rollouts(digit_task, tmp_path) -> None:  # noqa: F811
    records: list[dict] = []
    flags = _ppo_flags(digit_task, "--train-iters", "2", "--kl-coef", "0.1", "--vf-coef", "0.5")
    trainer = Trainer(
        parse_args([*flags, "--save", str(tmp_path)]),
        on_metrics=records.append,
        rollouts=colocated_rollouts,
    )
    assert isinstance(trainer.objective, PPOLoss) and trainer.objective.kl_coef == 0.1
    model = trainer.model
    assert isinstance(model, PolicyAndCritic)
    start = copy.deepcopy(model.state_dict())
    summary = trainer.fit()
    assert summary.checkpoint is not None
    moved = {
        part: any(
            not torch.equal(tensor, start[name])
            for name, tensor in model.state_dict().items()
            if name.startswith(part)
        )
        for part in ("policy.", "critic.")
    }
    assert moved == {"policy.": True, "critic.": True}
    assert {
        "reward", "reward_std", "kl", "loss/policy", "loss/value", "policy/clipfrac",
        "value/clipfrac", "rollout_tokens_per_s",
    } <= set(records[-1]["objective"])  # fmt: skip
    assert trainer.objective.rollouts.weight_bytes_copied() == 0
    # Resuming would take the trained policy for the reference: refused before any worker,
    # and by the objective itself should a worker be started anyway.
    resumed = parse_args([*flags, "--load", str(tmp_path), "--train-iters", "3"])
    with pytest.raises(ValueError, match=r"--stage ppo with --load .*resuming is not supported"):
        check_paths(resumed)
    worker = Trainer(resumed, rollouts=colocated_rollouts)
    worker.load()
    with pytest.raises(ValueError, match="resumed at step 2"):
        worker.train_step()


@pytest.mark.slow  # a PPO step, then the converter's process (~1 min on the busy 2-core box)
def test_a_ppo_checkpoint_converts_its_policy_to_transformers(digit_task, tmp_path) -> None:  # noqa: F811
    """`meshline convert` of a --stage ppo checkpoint (policy and critic side by side) writes
    the trained policy as an HF model; transformers loads it and its logits are the policy's."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    save, out = tmp_path / "ppo", tmp_path / "hf"
    trainer = Trainer(
        parse_args([*_ppo_flags(digit_task, "--train-iters", "1"), "--save", str(save)]),
        rollouts=colocated_rollouts,
    )
    trainer.fit()
    script = Path(sys.executable).with_name("meshline")
    command = [str(script)] if script.is_file() else [sys.executable, "-m", "services.cli"]
    root = Path(__file__).resolve().parents[2]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [*command, "convert", "--load-format", "native", "--save-format", "hf",
         "--load-dir", str(save), "--save-dir", str(out)],
        cwd=root, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    policy = trainer.model.policy.eval()
    ids = torch.tensor([[1, 4, 5, 6, 14, 7]])
    with torch.no_grad():
        expected = policy(ids).float()
        got = hf(ids).logits.float()
    assert (got - expected).abs().max() < 1e-4


def test_a_ppo_checkpoint_converts_its_critic_to_transformers(digit_task, tmp_path) -> None:  # noqa: F811
    """`--ppo-model critic` writes the PPO run's value model as a reward model is written:
    transformers' AutoModelForSequenceClassification loads it, its `score` of every position is
    the critic's value there and its pooled logit the value of the last token."""
    from transformers import AutoModelForSequenceClassification

    from services.converter.job import convert
    from services.converter.options import ConvertOptions

    save, out = tmp_path / "ppo", tmp_path / "critic"
    trainer = Trainer(
        parse_args([*_ppo_flags(digit_task, "--train-iters", "1"), "--save", str(save)]),
        rollouts=colocated_rollouts,
    )
    trainer.fit()
    report = convert(ConvertOptions("native", "hf", save, out, dtype="fp32", ppo_model="critic"))
    assert report.verify is not None and report.verify.passed  # the converter's own check
    hf = AutoModelForSequenceClassification.from_pretrained(out).eval()
    assert hf.config.num_labels == 1
    critic = trainer.model.critic.eval()
    ids = torch.tensor(
        [[1, 4, 5, 6, 14, 7], [1, 9, 14, 12, 5, 6]]
    )  # no <pad> (3): HF pools before it
    with torch.no_grad():
        expected = critic(ids)[..., 0].float()
        per_token = hf.score(hf.model(ids).last_hidden_state)[..., 0].float()
        pooled = hf(ids, attention_mask=torch.ones_like(ids)).logits[:, 0].float()
    assert expected.abs().max() > 1e-3  # a trained head, not zeros
    assert (per_token - expected).abs().max() < 1e-5
    assert (pooled - expected[:, -1]).abs().max() < 1e-5
    # --ppo-model policy (also the default) writes the language model.
    from transformers import AutoModelForCausalLM

    convert(ConvertOptions("native", "hf", save, tmp_path / "policy", ppo_model="policy"))
    lm = AutoModelForCausalLM.from_pretrained(tmp_path / "policy").eval()
    with torch.no_grad():
        logits = trainer.model.policy.eval()(ids).float()
        assert (lm(ids).logits.float() - logits).abs().max() < 1e-4
    with pytest.raises(ValueError, match=r"--ppo-model critic with --load-format hf"):
        ConvertOptions("hf", "native", out, tmp_path / "x", ppo_model="critic")
    with pytest.raises(ValueError, match=r"--ppo-model critic: .* is not a --stage ppo"):
        convert(ConvertOptions("native", "hf", _policy_only(tmp_path, out), tmp_path / "y",
                               ppo_model="critic"))  # fmt: skip


def _policy_only(tmp_path, critic_hf):
    """A native checkpoint of one model (not a PPO run): the critic's export read back."""
    from services.converter.job import convert
    from services.converter.options import ConvertOptions

    native = tmp_path / "native"
    convert(ConvertOptions("hf", "native", critic_hf, native, dtype="fp32"))
    return native
