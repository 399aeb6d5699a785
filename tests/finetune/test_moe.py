"""MoE: logit parity with HF `MixtralForCausalLM`, auxiliary losses against HF's formula,
capacity dropping, shared experts, and the aux-loss gradient path. fp32, CPU."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import MixtralConfig, MixtralForCausalLM
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

from kernels.cross_entropy import cross_entropy
from models import build_model
from models.hf_adapters import from_hf, to_hf
from models.hf_config import hf_config
from models.moe import MoE, MoEConfig, moe_layers, set_aux_loss_scale
from models.registry import get_config
from tests.models.test_hf_parity import _randomise

ATOL = 1e-5


def _hf_mixtral(config) -> MixtralForCausalLM:
    hf = MixtralForCausalLM._from_config(
        MixtralConfig(**hf_config(config)), attn_implementation="eager"
    ).eval()
    _randomise(hf, seed=0)
    return hf


@pytest.mark.parametrize("fused", [True, False])
def test_logits_equal_hf_mixtral(fused):
    config = get_config("tiny-mixtral", fused_qkv=fused)
    hf = _hf_mixtral(config)
    ours = build_model(config, device="cpu").eval()
    missing = ours.load_state_dict(from_hf(hf.state_dict(), config), strict=True)
    assert not missing.missing_keys
    x = torch.randint(0, config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(x, output_router_logits=True)
        got = ours(x)
    assert (got - expected.logits).abs().max().item() <= ATOL
    # The state dict converts back to HF's keys exactly.
    back = to_hf(ours.state_dict(), config)
    assert set(back) == set(hf.state_dict())


def test_load_balancing_loss_matches_hf_formula():
    """One layer: ours (Megatron's normalisation, f = copies / (N·K)) equals HF's
    `load_balancing_loss_func` (f = copies / N) divided by K."""
    moe = {"num_experts": 4, "top_k": 2, "aux_loss_coeff": 1.0}
    config = get_config("tiny-mixtral", num_layers=1, moe=moe)
    hf = _hf_mixtral(config)
    ours = build_model(config, device="cpu").eval()
    ours.load_state_dict(from_hf(hf.state_dict(), config))
    x = torch.randint(0, config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        router_logits = hf(x, output_router_logits=True).router_logits
        ours(x)
    hf_aux = load_balancing_loss_func(router_logits, 4, 2)
    ((_, layer),) = moe_layers(ours)
    assert abs(layer.last_aux_loss.item() - hf_aux.item() / 2) <= 1e-6


def _moe(**kw) -> MoE:
    torch.manual_seed(0)
    moe = MoE(16, 24, MoEConfig(num_experts=4, top_k=2, **kw))
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
    return moe


def _reference(moe: MoE, x_NE: torch.Tensor, keep=None) -> torch.Tensor:
    """Token by token: Σ_k w_k · SwiGLU expert_k(x) (copies outside `keep` skipped)."""
    _, w, idx = moe.route(x_NE)
    out = torch.zeros_like(x_NE)
    for n in range(x_NE.shape[0]):
        for k in range(idx.shape[1]):
            if keep is not None and not keep[n, k]:
                continue
            e = int(idx[n, k])
            gate, up = (moe.experts.gate_up_proj[e] @ x_NE[n]).chunk(2)
            out[n] += w[n, k] * (moe.experts.down_proj[e] @ (torch.nn.functional.silu(gate) * up))
    return out


def test_capacity_drops_later_tokens_and_dropless_keeps_all():
    x = torch.randn(1, 32, 16, generator=torch.Generator().manual_seed(3))
    dropless = _moe()
    torch.testing.assert_close(dropless(x)[0], _reference(dropless, x[0]), atol=1e-5, rtol=1e-5)
    capped = _moe(capacity_factor=0.5)
    _, _, idx = capped.route(x[0])
    keep = capped.keep_mask(idx)
    capacity = math.ceil(0.5 * 32 * 2 / 4)
    counts = torch.bincount(idx[keep], minlength=4)
    assert (counts <= capacity).all() and not keep.all()
    for e in range(4):  # the kept copies of an expert are its earliest ones
        positions = (idx == e).flatten().nonzero().flatten()
        assert keep.flatten()[positions].tolist() == sorted(
            keep.flatten()[positions].tolist(), reverse=True
        )
    torch.testing.assert_close(capped(x)[0], _reference(capped, x[0], keep), atol=1e-5, rtol=1e-5)


def test_shared_experts_add_a_dense_branch():
    moe = _moe(num_shared_experts=1)
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(4))
    shared = moe.shared_experts(x.reshape(-1, 16))
    torch.testing.assert_close(
        moe(x).reshape(-1, 16), _reference(moe, x.reshape(-1, 16)) + shared, atol=1e-5, rtol=1e-5
    )


def test_aux_and_z_loss_reach_the_router_gradient():
    """The injected auxiliary losses give the router exactly the gradient of (main + aux)."""
    set_aux_loss_scale(1.0)  # a trainer run earlier in this process leaves its own scale
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(5))
    moe = _moe(aux_loss_coeff=0.1, z_loss_coeff=0.01).train()
    main = moe(x).square().sum()
    main.backward()
    injected = moe.gate.weight.grad.clone()
    moe.zero_grad()
    logits, _, idx = moe.route(x.reshape(-1, 16))
    explicit = moe.aux_loss(logits, idx)
    moe.eval()
    (moe(x).square().sum() + explicit).backward()
    torch.testing.assert_close(injected, moe.gate.weight.grad, atol=1e-6, rtol=1e-5)
    z = torch.logsumexp(logits, -1).square().mean()
    assert explicit.item() > 0.01 * z.item()


def test_moe_model_trains():
    config = get_config("tiny-mixtral", moe={"num_experts": 4, "top_k": 2, "aux_loss_coeff": 0.01})
    model = build_model(config, device="cpu").train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(8):
        loss = cross_entropy(model(x[:, :-1]), x[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5


def test_bad_moe_settings_are_named():
    with pytest.raises(ValueError, match="--moe-router-topk"):
        MoEConfig(num_experts=2, top_k=3)
    with pytest.raises(ValueError, match="capacity-factor"):
        MoEConfig(capacity_factor=0.0)


def test_trainer_builds_and_trains_the_moe_family(tmp_path):
    """`--model tiny-mixtral` trains in the trainer (bf16 master weights) and resumes exactly."""
    from services.trainer.arguments import parse_args
    from training.loop import Trainer

    flags = ["--model", "tiny-mixtral", "--mock-data", "--seq-length", "32", "--bf16",
             "--micro-batch-size", "2", "--train-iters", "4", "--lr", "1e-2",
             "--lr-warmup-iters", "1", "--eval-interval", "0"]  # fmt: skip
    straight = Trainer(parse_args(flags))
    assert isinstance(straight.model.layers["0"].mlp, MoE)
    losses = [straight.train_step().loss for _ in range(4)]
    assert all(math.isfinite(x) for x in losses)
    first = Trainer(parse_args([*flags, "--save", str(tmp_path)]))
    first.train_step(), first.train_step()
    first.save()
    resumed = Trainer(parse_args([*flags, "--load", str(tmp_path)]))
    resumed.load()
    resumed.train_step(), resumed.train_step()
    for (name, a), b in zip(
        straight.model.named_parameters(), resumed.model.parameters(), strict=True
    ):
        assert torch.equal(a, b), name


def test_parameter_and_flop_counts_of_moe_by_hand():
    """tiny-mixtral: E 64, F 96, L 2, H 4 (D 16), 2 KV heads, V 256, X 4 experts, top-2."""
    from models.accounting import active_parameters, count_parameters, flops_per_token

    config = get_config("tiny-mixtral")
    attention = 64 * (64 + 2 * 32) + 64 * 64  # [q; k; v] and o
    expert = 3 * 64 * 96  # [gate; up] 2F×E and down E×F
    router, norms = 4 * 64, 2 * 64
    per_layer = attention + 4 * expert + router + norms
    total = 256 * 64 + 2 * per_layer + 64 + 256 * 64  # embedding, layers, final norm, head
    assert count_parameters(config) == total == 205_632
    model = build_model(config)  # meta: nothing allocated
    assert sum(p.numel() for p in model.parameters()) == total
    active = total - 2 * (4 - 2) * expert  # a token skips 2 of the 4 experts in each layer
    assert active_parameters(config) == active == 131_904
    seq = 32
    expected = 6 * (active - 256 * 64) + 12 * 2 * 4 * 16 * seq
    assert flops_per_token(config, seq) == expected
    dense = get_config("tiny-mixtral", moe=None)
    assert active_parameters(dense) == count_parameters(dense)
    shared = get_config("tiny-mixtral", moe={"num_experts": 4, "top_k": 1, "num_shared_experts": 2})
    assert active_parameters(shared) == total - 2 * 3 * expert + 2 * 2 * expert
    assert sum(p.numel() for p in build_model(shared).parameters()) == count_parameters(shared)


def test_tp_plan_of_moe_names_the_experts():
    from models.parallel_plan import match_plan, tp_plan

    config = get_config("tiny-mixtral")
    plan = tp_plan(config, sequence_parallel=False)
    assert plan["layers.*.mlp.experts"] == "moe_experts"
    assert not any(k.endswith(("mlp.gate_up_proj", "mlp.down_proj")) for k in plan)
    model = build_model(config)
    resolved = match_plan(plan, [n for n, _ in model.named_modules()])
    assert {n for n, s in resolved.items() if s == "moe_experts"} == {
        "layers.0.mlp.experts",
        "layers.1.mlp.experts",
    }
    assert "layers.0.mlp.gate" not in resolved  # the router stays replicated


def test_moe_flags_reach_the_model_config():
    from services.trainer.arguments import parse_args
    from training.setup import build_model_config

    def config(*flags):
        return build_model_config(parse_args(["--mock-data", *flags]))

    dense_to_moe = config("--model", "tiny-llama", "--num-experts", "4", "--moe-router-topk", "1")
    assert dense_to_moe.moe == MoEConfig(num_experts=4, top_k=1)
    assert len(moe_layers(build_model(dense_to_moe))) == dense_to_moe.num_layers
    mixtral = config("--model", "tiny-mixtral", "--moe-z-loss-coeff", "0.01")
    assert mixtral.moe == MoEConfig(num_experts=4, top_k=2, z_loss_coeff=0.01)
    with pytest.raises(ValueError, match="has no experts: --moe-router-topk need --num-experts"):
        config("--model", "tiny-llama", "--moe-router-topk", "1")
    with pytest.raises(ValueError, match="--moe-router-topk 8 must be in"):
        config("--model", "tiny-mixtral", "--moe-router-topk", "8")
    with pytest.raises(ValueError, match="--moe-z-loss-coeff must be >= 0"):
        config("--model", "tiny-mixtral", "--moe-z-loss-coeff", "-1")


def test_aux_loss_gradient_follows_the_set_scale():
    """The loop sets loss scale / micro-batches; the router's aux gradient scales with it."""
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(5))
    moe = _moe(z_loss_coeff=0.1).train()
    grads = []
    for scale in (1.0, 0.25):
        set_aux_loss_scale(scale)
        moe.zero_grad()
        moe(x).sum().mul(0.0).backward()  # only the injected z-loss reaches the router
        grads.append(moe.gate.weight.grad.clone())
    set_aux_loss_scale(1.0)
    assert grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[1], grads[0] * 0.25)
