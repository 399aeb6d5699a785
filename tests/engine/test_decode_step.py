"""The lean decode step gives exactly the module forward's logits and cache, or declines.

Bit-identical (torch.equal), not close: the step must call the same kernels in the same order,
so greedy, beam and sampled outputs cannot change with `--decode-step`.
"""

from __future__ import annotations

import pytest
import torch

from engine.decode_step import DecodeStep
from engine.engine import Engine, EngineConfig
from engine.sampling import SamplingConfig
from engine.tokens import TokenizerInfo
from kernels.packed_linear import PackedLinear, pack_linears
from models import build_model
from models.config import ModelConfig
from models.kv_cache import KVCache
from models.lora import LoraConfig, apply_lora

VOCAB = 96


def _model(
    device: str = "cpu", perturb: tuple[str, ...] = ("norm",), **overrides
) -> torch.nn.Module:
    fields = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        num_layers=2,
        num_attention_heads=4,
        num_kv_heads=2,
        ffn_hidden_size=96,
        max_position_embeddings=64,
        init_std=0.2,
    )
    fields.update(overrides)
    torch.manual_seed(0)
    model = build_model(ModelConfig(**fields), device=device).eval()
    with torch.no_grad():  # norm weights away from 1 (biases from 0), so a skipped one shows
        for name, param in model.named_parameters():
            if any(part in name for part in perturb):
                param.add_(0.1 * torch.randn(param.shape).to(param.device))
    return model


def _prefilled(model, lengths: list[int]) -> KVCache:
    """A cache whose row b holds a random prompt of lengths[b] (rows of unequal length)."""
    cache = KVCache.for_model(model, len(lengths), 32)
    gen = torch.Generator().manual_seed(5)
    with torch.inference_mode():
        for b, n in enumerate(lengths):
            ids = torch.randint(0, VOCAB, (1, n), generator=gen)
            model(ids, kv_cache=cache.rows(b, b + 1), logits_to_keep=1)
    return cache


def _clone(cache: KVCache) -> KVCache:
    copy = KVCache.__new__(KVCache)
    copy.k_BSKD = {k: v.clone() for k, v in cache.k_BSKD.items()}
    copy.v_BSKD = {k: v.clone() for k, v in cache.v_BSKD.items()}
    copy.key_mask_BS = cache.key_mask_BS.clone()
    copy.lengths_B = cache.lengths_B.clone()
    copy.batch_size, copy.max_seq_len = cache.batch_size, cache.max_seq_len
    return copy


def _assert_same_steps(model, lengths: list[int], steps: int = 3) -> None:
    decode = DecodeStep(model)
    ours, theirs = _prefilled(model, lengths), None
    theirs = _clone(ours)
    ids_B1 = torch.randint(0, VOCAB, (len(lengths), 1), generator=torch.Generator().manual_seed(9))
    with torch.inference_mode():
        for _ in range(steps):
            step = ours.begin(1, None)
            got = decode(ids_B1, ours, step)
            ours.commit(step)
            want = model(ids_B1, kv_cache=theirs, logits_to_keep=1)[:, -1]
            assert torch.equal(got, want)
            ids_B1 = want.argmax(-1, keepdim=True)
    for key in ours.k_BSKD:
        assert torch.equal(ours.k_BSKD[key], theirs.k_BSKD[key])
        assert torch.equal(ours.v_BSKD[key], theirs.v_BSKD[key])
    assert torch.equal(ours.lengths_B, theirs.lengths_B)
    assert torch.equal(ours.key_mask_BS, theirs.key_mask_BS)


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"fused_qkv": False, "fused_gate_up": False},
        {"qk_norm": True, "qkv_bias": True},
        {"qk_norm": True, "fused_qkv": False, "attention_bias": True, "mlp_bias": True},
        {"num_kv_heads": 4, "tie_word_embeddings": True},
        {"rope_scaling": {"type": "linear", "factor": 2.0}},
    ],
    ids=["fused", "separate", "qk-norm-bias", "separate-qk-norm-bias", "mha-tied", "linear-rope"],
)
@pytest.mark.parametrize("lengths", [[5], [5, 5, 5], [3, 7, 1]], ids=["one", "even", "uneven"])
def test_logits_and_cache_identical_to_module_forward(overrides, lengths):
    _assert_same_steps(_model(**overrides), lengths)


def test_packed_linear_layers_identical():
    model = _model()
    pack_linears(model)
    assert isinstance(model.layers["0"].mlp.down_proj, PackedLinear)
    _assert_same_steps(model, [4, 6])


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({"position_embedding": "alibi"}, "rotates q and k"),
        ({"sliding_window": 4}, "sliding_window"),
        ({"activation": "gelu", "fused_gate_up": False}, "activation"),
        ({"norm_type": "layernorm"}, "RMSNorm"),
        (
            {
                "rope_scaling": {
                    "type": "dynamic",
                    "factor": 2.0,
                    "original_max_position_embeddings": 32,
                }
            },
            "dynamic",
        ),
    ],
)
def test_declines_what_it_does_not_cover(overrides, reason):
    step, why = DecodeStep.build(_model(**overrides))
    assert step is None and reason in why


def test_declines_lora_hooks_and_training():
    model = _model()
    model.train()
    assert DecodeStep.build(model)[0] is None
    model.eval()
    handle = model.layers["1"].mlp.register_forward_hook(lambda *args: None)
    step, why = DecodeStep.build(model)
    assert step is None and "hooks" in why
    handle.remove()
    apply_lora(model, LoraConfig(r=2, target_modules=["qkv_proj"]))
    step, why = DecodeStep.build(model.eval())
    assert step is None and "LoRA" in why


@pytest.mark.parametrize("cpu_linear", ["dense", "packed", "colmajor"])
def test_engine_outputs_equal_with_either_decode_step(cpu_linear):
    """Continuous batching (rows of unequal length join and leave) with greedy, sampled, beam and
    repetition-penalty requests: identical tokens and log-probabilities either way."""
    prompts = [[5, 9, 11], [7] * 8, [3, 4, 5, 6, 7, 8], [10, 20]]
    configs = [
        SamplingConfig(max_new_tokens=9),
        SamplingConfig(max_new_tokens=5, do_sample=True, top_p=0.9, seed=4),
        SamplingConfig(max_new_tokens=6, num_beams=2),
        SamplingConfig(max_new_tokens=7, repetition_penalty=1.3, logprobs=2),
    ]
    results = []
    for decode_step in ("lean", "module"):  # "auto" adds the C batch-1 step: test_native_step
        model = _model()
        config = EngineConfig(max_batch_rows=3, cpu_linear=cpu_linear, decode_step=decode_step)
        engine = Engine(model, TokenizerInfo(VOCAB), config)
        assert isinstance(engine.runner.decode_step, DecodeStep) == (decode_step == "lean")
        results.append(engine.generate(prompts, configs))
    for lean, module in zip(*results, strict=True):
        assert [(r.token_ids, r.cumulative_logprob) for r in lean] == [
            (r.token_ids, r.cumulative_logprob) for r in module
        ]


def test_bad_decode_step_value_names_the_flag():
    with pytest.raises(ValueError, match="--decode-step"):
        EngineConfig(decode_step="fast")
