"""Logit and loss parity with HF transformers through the state-dict adapters (fp32, CPU).

Each case builds the HF model (eager attention) with randomised weights — norm scales and biases
included, so a swapped or dropped tensor shows — converts its state dict with `from_hf`, and
compares. Tolerance: max |Δlogit| ≤ 1e-5 and |Δloss| ≤ 1e-5 in fp32.
"""

from __future__ import annotations

import pytest
import torch
from transformers import BloomConfig, BloomForCausalLM, LlamaConfig, LlamaForCausalLM

from kernels.cross_entropy import cross_entropy
from models import build_model
from models.hf_adapters import config_from_hf, from_hf, hf_config, to_hf
from models.registry import get_config

ATOL = 1e-5

CASES = {
    "llama": ("tiny-llama", {}),
    "llama-gqa": ("tiny-llama-gqa", {}),
    "llama-tied": ("tiny-llama", {"tie_word_embeddings": True}),
    "llama-unfused": ("tiny-llama-gqa", {"fused_qkv": False, "fused_gate_up": False}),
    "llama-rope-linear": ("tiny-llama", {"rope_scaling": {"type": "linear", "factor": 2.0}}),
    "internlm-bias": ("tiny-internlm", {}),
    "bloom": ("tiny-bloom", {}),
    "bloom-untied": ("tiny-bloom", {"tie_word_embeddings": False}),
}


def _randomise(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if "norm" in name or "ln_f" in name:
                param.copy_((1.0 + 0.2 * noise) if name.endswith("weight") else 0.1 * noise)
            else:
                param.copy_(0.08 * noise)


def hf_model_for(config) -> torch.nn.Module:
    """The HF reference model class that implements `config` exactly (eager attention)."""
    if config.family == "bloom":
        return BloomForCausalLM._from_config(
            BloomConfig(**hf_config(config)), attn_implementation="eager"
        ).eval()
    llama_like = hf_config(config.replace(family="llama"))
    return LlamaForCausalLM._from_config(
        LlamaConfig(**llama_like), attn_implementation="eager"
    ).eval()


def pair(case: str, seed: int = 0):
    """(HF model, Meshline model with the converted weights, config)."""
    name, overrides = CASES[case]
    config = get_config(name, **overrides)
    hf = hf_model_for(config)
    _randomise(hf, seed)
    ours = build_model(config, device="cpu").eval()
    ours.load_state_dict(from_hf(hf.state_dict(), config), strict=True)
    return hf, ours, config


def _tokens(batch: int, seq: int, vocab: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_and_loss_match_hf(case):
    hf, ours, config = pair(case)
    ids = _tokens(2, 24, config.vocab_size)
    with torch.no_grad():
        out = hf(input_ids=ids, labels=ids)
        logits = ours(ids)
    assert (logits - out.logits).abs().max().item() <= ATOL
    loss = cross_entropy(logits[:, :-1], ids[:, 1:])
    assert abs(loss.item() - out.loss.item()) <= ATOL


@pytest.mark.parametrize("case", ["llama-gqa", "bloom"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_matches_hf_on_real_tokens(case, side):
    hf, ours, config = pair(case)
    ids = _tokens(3, 20, config.vocab_size)
    real = torch.ones(3, 20, dtype=torch.bool)
    pad = [0, 5, 11]
    for row, n in enumerate(pad):
        if n:
            if side == "left":
                real[row, :n] = False
            else:
                real[row, -n:] = False
    position_ids = (real.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=real.long(), position_ids=position_ids).logits
        logits = ours(ids, key_padding_mask_BS=real, position_ids_BS=position_ids)
    assert (logits - expected)[real].abs().max().item() <= ATOL


@pytest.mark.parametrize("case", ["llama", "bloom"])
def test_packed_sequences_equal_separate_documents(case):
    hf, ours, config = pair(case)
    lengths = [7, 12, 5]
    docs = [_tokens(1, n, config.vocab_size, seed=10 + i) for i, n in enumerate(lengths)]
    packed = torch.cat(docs, dim=1)
    segment_ids = torch.cat([torch.full((1, n), i) for i, n in enumerate(lengths)], dim=1)
    with torch.no_grad():
        logits = ours(packed, segment_ids_BS=segment_ids)
        separate = torch.cat([ours(doc) for doc in docs], dim=1)
        reference = torch.cat([hf(input_ids=doc).logits for doc in docs], dim=1)
    assert (logits - separate).abs().max().item() <= ATOL
    assert (logits - reference).abs().max().item() <= ATOL


def test_baichuan_w_pack_maps_onto_llama():
    """Baichuan-7B is Llama math with q/k/v packed as W_pack = [q; k; v]."""
    config = get_config("tiny-baichuan")
    hf = hf_model_for(config)
    _randomise(hf, 3)
    llama_sd = hf.state_dict()
    baichuan_sd = {}
    for key, tensor in llama_sd.items():
        if ".self_attn.q_proj." in key:
            parts = [llama_sd[key.replace("q_proj", p)] for p in ("q_proj", "k_proj", "v_proj")]
            baichuan_sd[key.replace("q_proj", "W_pack")] = torch.cat(parts, dim=0)
        elif ".self_attn.k_proj." not in key and ".self_attn.v_proj." not in key:
            baichuan_sd[key] = tensor
    ours = build_model(config, device="cpu").eval()
    ours.load_state_dict(from_hf(baichuan_sd, config), strict=True)
    ids = _tokens(2, 16, config.vocab_size)
    with torch.no_grad():
        assert (ours(ids) - hf(input_ids=ids).logits).abs().max().item() <= ATOL
    exported = to_hf(ours.state_dict(), config)
    assert exported.keys() == baichuan_sd.keys()
    assert all(torch.equal(exported[k], baichuan_sd[k]) for k in exported)


@pytest.mark.parametrize("case", sorted(CASES))
def test_adapters_round_trip_bit_exactly(case):
    hf, ours, config = pair(case, seed=5)
    hf_sd = {k: v for k, v in hf.state_dict().items()}
    back = to_hf(from_hf(hf_sd, config), config)
    if config.tie_word_embeddings:
        hf_sd.pop("lm_head.weight")  # HF saves tied heads once
    assert back.keys() == hf_sd.keys()
    assert all(torch.equal(back[k], hf_sd[k]) for k in back)
    ours_sd = ours.state_dict()
    again = from_hf(to_hf(ours_sd, config), config)
    assert again.keys() == ours_sd.keys()
    assert all(torch.equal(again[k], ours_sd[k]) for k in again)


def test_from_hf_rejects_unknown_bloom_tensor():
    config = get_config("tiny-bloom")
    with pytest.raises(
        ValueError, match=r"unexpected Bloom tensor 'transformer\.h\.0\.mystery\.weight'"
    ):
        from_hf({"transformer.h.0.mystery.weight": torch.zeros(1)}, config)


@pytest.mark.parametrize("case", sorted(CASES))
def test_hf_config_round_trip(case):
    name, overrides = CASES[case]
    config = get_config(name, **overrides)
    again = config_from_hf(hf_config(config), fused_qkv=config.fused_qkv)
    again = again.replace(fused_gate_up=config.fused_gate_up, extra=config.extra)
    if config.family == "bloom":  # ALiBi: HF's BloomConfig carries no position limit
        again = again.replace(max_position_embeddings=config.max_position_embeddings)
    assert again == config


def test_config_from_hf_reads_published_layouts():
    baichuan13 = config_from_hf(
        {"model_type": "baichuan", "vocab_size": 125696, "hidden_size": 5120,
         "num_hidden_layers": 40, "num_attention_heads": 40, "intermediate_size": 13696,
         "model_max_length": 4096, "rms_norm_eps": 1e-6}
    )  # fmt: skip
    assert baichuan13.position_embedding == "alibi" and baichuan13.norm_head
    assert baichuan13.max_position_embeddings == 4096
    with pytest.raises(ValueError, match="model_type 'gpt_neox' is not supported"):
        config_from_hf({"model_type": "gpt_neox"})


@pytest.mark.parametrize("case", ["llama-gqa", "bloom", "internlm-bias"])
def test_gradients_match_hf(case):
    """Backward parity: HF's parameter gradients, converted like weights, equal ours."""
    hf, ours, config = pair(case)
    ids = _tokens(2, 16, config.vocab_size)
    hf(input_ids=ids, labels=ids).loss.backward()
    cross_entropy(ours(ids)[:, :-1], ids[:, 1:]).backward()
    hf_grads = {name: p.grad for name, p in hf.named_parameters()}
    if config.tie_word_embeddings:
        hf_grads.pop("lm_head.weight", None)  # the tied matrix's gradient sits on the embedding
    expected = from_hf(hf_grads, config)
    for name, param in ours.named_parameters():
        assert (param.grad - expected[name]).abs().max().item() <= ATOL, name
