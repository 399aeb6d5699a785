"""--stage grpo end to end: rollouts from the colocated engine, a verifiable reward, the loop's
accumulation and checkpoints.

The learnable task: the prompt "d =" (d a digit), the answer d, one completion token, exact
match. A 16-token word-level tokenizer keeps the untrained policy's success rate near 1/16, so
groups of 8 see some successes.
"""

from __future__ import annotations

import json

import pytest
import torch

from services.trainer.arguments import parse_args
from services.trainer.rollouts import colocated_rollouts
from training.loop import Trainer
from training.objectives.grpo import GRPOLoss
from training.rl_sections import RLSection

DIGITS = [str(d) for d in range(10)]


@pytest.fixture(scope="module")
def digit_task(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    directory = tmp_path_factory.mktemp("digits")
    vocab = {tok: i for i, tok in enumerate(["<unk>", "<s>", "</s>", "<pad>", *DIGITS, "=", "?"])}
    rust = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    rust.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=rust,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    ).save_pretrained(directory / "tok")
    prompts = directory / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": f"{d} =", "answer": d}) + "\n" for d in DIGITS)
    )
    return directory / "tok", prompts


def _flags(task, *extra: str) -> list[str]:
    tok, prompts = task
    return [
        "--model", "tiny-llama", "--vocab-size", "16", "--stage", "grpo",
        "--data-path", str(prompts), "--tokenizer-type", "PretrainedFromHF",
        "--tokenizer-name-or-path", str(tok), "--seq-length", "8", "--max-prompt-length", "4",
        "--max-completion-length", "1", "--num-generations", "8", "--micro-batch-size", "5",
        "--global-batch-size", "10", "--lr", "5e-3", "--lr-decay-style", "constant",
        "--eval-interval", "0", "--log-interval", "1", "--spike-factor", "0", "--seed", "2",
        "--loss-type", "grpo", "--reward-funcs", "exact_match", *extra,
    ]  # fmt: skip


@torch.no_grad()
def _greedy_exact_match(trainer: Trainer) -> float:
    """Greedy answers by the module's own forward (not the engine), scored against `answer`."""
    data, model = trainer.train_data, trainer.model
    model.eval()
    right = 0
    for ids, record in zip(data.prompts.ids, data.records, strict=True):
        token = int(model(torch.tensor([ids]))[0, -1].argmax())
        right += data.prompts.tokenizer.decode([token]).strip() == record["answer"]
    model.train()
    return right / len(data.records)


@pytest.mark.slow
def test_grpo_raises_exact_match_from_below_02_to_above_08(digit_task) -> None:
    records: list[dict] = []
    trainer = Trainer(
        parse_args(_flags(digit_task, "--train-iters", "40")),
        on_metrics=records.append,
        rollouts=colocated_rollouts,
    )
    assert isinstance(trainer.objective, GRPOLoss)
    trainer.fit()
    first, last = records[0]["objective"], records[-1]["objective"]
    assert first["reward"] < 0.2  # the sampled policy's exact-match rate at step 1
    assert last["reward"] > 0.8
    assert _greedy_exact_match(trainer) > 0.8
    assert {"reward", "reward_std", "clip_ratio/region", "rollout_tokens_per_s"} <= set(first)
    assert trainer.objective.rollouts.weight_bytes_copied() == 0


def test_a_resumed_grpo_run_continues_bit_exactly(digit_task, tmp_path) -> None:
    small = ("--num-generations", "4", "--micro-batch-size", "2", "--global-batch-size", "4")
    straight: list[dict] = []
    first = Trainer(
        parse_args([*_flags(digit_task, "--train-iters", "4", *small)]),
        on_metrics=straight.append,
        rollouts=colocated_rollouts,
    )
    first.fit()
    saved = tmp_path / "run"
    part = Trainer(
        parse_args([*_flags(digit_task, "--train-iters", "2", *small), "--save", str(saved)]),
        rollouts=colocated_rollouts,
    )
    part.fit()
    resumed: list[dict] = []
    second = Trainer(
        parse_args([*_flags(digit_task, "--train-iters", "4", *small), "--load", str(saved)]),
        on_metrics=resumed.append,
        rollouts=colocated_rollouts,
    )
    assert second.load() == 2
    second.fit()
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight[2:]]
    assert [r["objective"]["reward"] for r in resumed] == [
        r["objective"]["reward"] for r in straight[2:]
    ]
    weights = second.model.state_dict()
    for name, tensor in first.model.state_dict().items():
        assert torch.equal(tensor, weights[name]), name


def _fixed_rollouts(vocab: int, count: int, seed: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    rows = []
    rewards = torch.randint(0, 2, (count,), generator=gen).float()
    from training.objectives.rl_losses import group_advantages

    advantages = group_advantages(rewards, 4, "group")
    for i in range(count):
        ids = torch.randint(0, vocab, (10,), generator=gen)
        mask = torch.zeros(10, dtype=torch.long)
        mask[3 : 3 + 1 + i % 7] = 1
        rows.append({
            "input_ids": ids,
            "completion_mask": mask,
            "advantages": advantages[i],
            "old_logps": -2.8 - 0.3 * torch.rand(9, generator=gen),
            "ref_logps": -2.8 - 0.3 * torch.rand(9, generator=gen),
        })  # fmt: skip
    return rows


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_1x8_and_8x1_accumulation_give_the_same_loss_curve(digit_task, loss_type) -> None:
    rollouts = _fixed_rollouts(16, 8 * 5, seed=4)
    curves = []
    for mbs in ("1", "8"):
        flags = _flags(
            digit_task, "--train-iters", "5", "--micro-batch-size", mbs, "--global-batch-size",
            "8", "--loss-type", loss_type, "--beta", "0.04", "--lr", "1e-2",
        )  # fmt: skip
        records: list[dict] = []
        trainer = Trainer(
            parse_args(flags), datasets=(rollouts, rollouts), on_metrics=records.append
        )
        trainer.fit()
        curves.append([r["loss"] for r in records])
    assert curves[0] == pytest.approx(curves[1], abs=1e-3)
    assert abs(curves[0][-1] - curves[0][0]) > 1e-3  # the weights moved


def test_batch_scaled_advantages_do_not_depend_on_the_micro_batching(digit_task) -> None:
    """--scale-rewards batch divides by the std of the whole step's rewards (trl's gathered
    generation batch), not of each micro-batch: 2x5 and 1x10 prompts give the same steps (the
    on-policy loss is 0 here, one-token completions: the gradients tell)."""
    curves = []
    for mbs in ("5", "10"):
        flags = _flags(
            digit_task, "--train-iters", "2", "--micro-batch-size", mbs, "--scale-rewards",
            "batch", "--loss-type", "dapo",
        )  # fmt: skip
        records: list[dict] = []
        Trainer(parse_args(flags), on_metrics=records.append, rollouts=colocated_rollouts).fit()
        curves.append([v for r in records for v in (r["loss"], r["grad_norm"])])
    assert curves[0] == pytest.approx(curves[1], rel=1e-5, abs=1e-6)
    assert all(norm > 0.1 for norm in curves[0][1::2])


@pytest.mark.parametrize(
    ("setting", "value", "flag"),
    [
        ("tensor_model_parallel_size", 2, "--tensor-model-parallel-size 2"),
        ("pipeline_model_parallel_size", 2, "--pipeline-model-parallel-size 2"),
        ("zero_stage", 3, "--zero-stage 3"),
    ],
)
def test_online_rl_beyond_replicated_data_parallelism_is_refused_by_flag(
    digit_task, setting, value, flag
) -> None:
    for stage in ("grpo", "ppo"):
        config = parse_args(_flags(digit_task, "--global-batch-size", "20"))
        config.run.stage = stage
        config.rl = RLSection()  # the digit task's GRPO settings, which ppo does not read
        setattr(config.parallel, setting, value)
        with pytest.raises(ValueError, match=f"{flag} with --stage {stage}"):
            config.validate(2)
    config = parse_args(_flags(digit_task, "--global-batch-size", "20"))
    assert config.validate(2) is config  # plain data parallelism runs


def test_the_launcher_reads_a_prompt_file_as_the_trainer_does(digit_task, tmp_path) -> None:
    """`meshline train --nproc-per-node N` checks the inputs before starting workers: a prompt
    file passes (it was looked up as a token dataset and refused), a broken line is named."""
    from training.launch_checks import check_inputs

    check_inputs(parse_args(_flags(digit_task)))
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "1 =", "answer": "1"}\nnot json\n')
    flags = _flags(digit_task)
    flags[flags.index("--data-path") + 1] = str(broken)
    with pytest.raises(ValueError, match=r"broken.jsonl:2"):
        check_inputs(parse_args(flags))
