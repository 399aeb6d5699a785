"""Issue #18 families against transformers' own classes (fp32, CPU, tiny random models).

For Llama-3 (llama3 RoPE, tied head), Qwen2 (qkv bias), Qwen3 (q/k norm, explicit head_dim),
Mistral (sliding window), Mixtral, Qwen2-MoE (gated shared expert) and Qwen3-MoE: transformers
writes a random checkpoint with `save_pretrained` (the on-disk layout users bring), Meshline loads
it with the inference engine's `--load-format hf` reader and must give transformers' logits and
its greedy and beam-search tokens, on prompts longer than the sliding window (8) and than the
original context of the rope-scaled model (16). Each feature is also shown to matter: switching
it off in Meshline's config changes the logits, so the parity is not vacuous.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from engine.engine import Engine
from engine.loading import load_checkpoint
from engine.sampling import SamplingConfig
from engine.tokens import TokenizerInfo
from models import build_model
from models.hf_adapters import config_from_hf, from_hf, hf_config
from models.registry import get_config
from tests.services.inference.helpers import hf_generate, prompt

FAMILIES = {
    "llama3": "tiny-llama3",
    "qwen2": "tiny-qwen2",
    "qwen3": "tiny-qwen3",
    "mistral": "tiny-mistral",
    "mixtral": "tiny-mixtral-hf",
    "qwen2_moe": "tiny-qwen2-moe",
    "qwen3_moe": "tiny-qwen3-moe",
}
FEATURE_OFF = {
    "llama3": {"rope_scaling": None},
    "qwen2": {"qkv_bias": False},
    "qwen3": {"qk_norm": False},
    "mistral": {"sliding_window": None},
    "mixtral": {"sliding_window": None},
}
"""A config change that removes the family's feature; its weights must still load (non-strict)."""
SEQ = 40  # > sliding window 8 and > tiny-llama3's original context 16
ATOL = 5e-5


def hf_model(name: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """transformers' class for registry config `name` (with `overrides` of its fields), with
    random non-trivial weights."""
    return _randomised(hf_config(get_config(name, **overrides)), seed)


def _randomised(fields: dict, seed: int = 0, scale: float = 0.15) -> torch.nn.Module:
    fields = dict(fields)
    model_type = fields.pop("model_type")
    fields.pop("architectures")
    config = AutoConfig.for_model(model_type, **fields)
    hf = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, param in hf.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(1.0 + 0.2 * noise if "norm" in pname else scale * noise)
    return hf


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(family, HF model, its save_pretrained directory)."""
    hf = hf_model(FAMILIES[request.param])
    directory = tmp_path_factory.mktemp("hf") / request.param
    hf.save_pretrained(directory)
    return request.param, hf, directory


def _ids(vocab: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (2, SEQ), generator=torch.Generator().manual_seed(seed))


def test_load_format_hf_gives_transformers_logits(family):
    name, hf, directory = family
    loaded = load_checkpoint(directory, load_format="hf")
    assert loaded.config.family == (name if name != "llama3" else "llama")
    ids = _ids(loaded.config.vocab_size)
    with torch.no_grad():
        expected = hf(ids).logits
        got = loaded.model(ids)
    assert (got - expected).abs().max().item() <= ATOL
    if name in FEATURE_OFF:  # the feature changes the logits: parity above is not vacuous
        off = build_model(loaded.config.replace(**FEATURE_OFF[name]), device="cpu").eval()
        off.load_state_dict(loaded.model.state_dict(), strict=False)
        with torch.no_grad():
            assert (off(ids) - expected).abs().max().item() > 1e-3


def test_config_round_trips_through_config_json(family):
    name, _, directory = family
    saved = json.loads((directory / "config.json").read_text())
    ours = config_from_hf(saved)
    want = get_config(FAMILIES[name])
    for field in want.__dataclass_fields__:
        if field != "extra":
            assert getattr(ours, field) == getattr(want, field), field
    written = hf_config(ours)
    for key, value in written.items():
        if key in saved and key not in ("architectures", "dtype"):
            assert saved[key] == value, key


def test_state_dict_round_trips_bit_exactly(family):
    name, hf, _ = family
    config = get_config(FAMILIES[name])
    state = hf.state_dict()
    ours = from_hf(state, config)
    back = _hf_keys(config, ours)
    assert set(back) == set(state)
    for key, tensor in state.items():
        assert torch.equal(back[key], tensor), key


def _hf_keys(config, ours):
    from models.hf_adapters import to_hf

    back = to_hf(ours, config)
    if config.tie_word_embeddings:
        back["lm_head.weight"] = back["model.embed_tokens.weight"]
    return back


def test_greedy_and_beam_tokens_equal_hf_generate(family):
    _, hf, directory = family
    loaded = load_checkpoint(directory, load_format="hf")
    vocab = loaded.config.vocab_size
    ids = prompt(24, vocab, seed=3)
    free = hf_generate(hf, ids, max_new_tokens=12, eos_token_id=None)
    eos = int(free[0, 24 + 6])  # a token the model really emits mid-sequence
    expected = hf_generate(hf, ids, max_new_tokens=12, eos_token_id=eos)
    engine = Engine(loaded.model, TokenizerInfo(vocab, eos_id=eos))
    [[greedy]] = engine.generate([ids], [SamplingConfig(max_new_tokens=12)])
    assert greedy.token_ids == expected[0, 24:].tolist()
    assert greedy.token_ids[-1] == eos
    beam = dict(max_new_tokens=8, num_beams=3, num_return_sequences=3)
    expected = hf_generate(hf, ids, eos_token_id=None, **beam)
    engine = Engine(loaded.model, TokenizerInfo(vocab, eos_id=None))
    [results] = engine.generate([ids], [SamplingConfig(**beam)])
    assert [r.token_ids for r in results] == expected[:, 24:].tolist()


def test_rope_scalings_match_transformers():
    """llama3 (in the families above), yarn (with and without mscale), dynamic and linear."""
    scalings = [
        {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
        {
            "type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 16,
            "beta_fast": 16.0,
            "mscale": 1.0,
            "mscale_all_dim": 0.5,
        },
        {"type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 16},
        {"type": "linear", "factor": 2.0},
    ]
    for scaling in scalings:
        config = get_config("tiny-llama", rope_scaling=scaling, max_position_embeddings=16)
        fields = hf_config(config)
        assert fields["rope_parameters"]["rope_type"] == scaling["type"]
        hf = _randomised(fields)
        ours = build_model(config, device="cpu").eval()
        ours.load_state_dict(from_hf(hf.state_dict(), config))
        plain = build_model(config.replace(rope_scaling=None), device="cpu").eval()
        plain.load_state_dict(ours.state_dict())
        ids = _ids(config.vocab_size)
        with torch.no_grad():
            expected = hf(ids).logits
            assert (ours(ids) - expected).abs().max().item() <= ATOL, scaling
            assert (plain(ids) - expected).abs().max().item() > 1e-3, scaling
        assert config_from_hf(hf.config.to_dict()).rope_scaling == scaling


@pytest.mark.parametrize(
    "change,field",
    [
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "rope_type"),
        (
            {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4},
            "layer_types",
        ),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ],
)
def test_math_changing_fields_it_cannot_honour_are_errors(change, field):
    base = hf_config(get_config("tiny-qwen2"))
    with pytest.raises(ValueError, match=field):
        config_from_hf({**base, **change})


def test_moe_fields_it_cannot_honour_are_errors():
    base = hf_config(get_config("tiny-qwen2-moe"))
    with pytest.raises(ValueError, match="mlp_only_layers"):
        config_from_hf({**base, "mlp_only_layers": [0]})
    with pytest.raises(ValueError, match="decoder_sparse_step"):
        config_from_hf({**base, "decoder_sparse_step": 2})


def test_published_sizes_are_registered():
    sizes = {
        "llama3.1-8B": (4096, 32, 32, 8, 14336, 128256),
        "llama3.2-1B": (2048, 16, 32, 8, 8192, 128256),
        "qwen2.5-7B": (3584, 28, 28, 4, 18944, 152064),
        "qwen3-8B": (4096, 36, 32, 8, 12288, 151936),
        "mistral-7B": (4096, 32, 32, 8, 14336, 32000),
        "mixtral-8x7B": (4096, 32, 32, 8, 14336, 32000),
        "qwen3-30B-A3B": (2048, 48, 32, 4, 768, 151936),
    }
    for name, (hidden, layers, heads, kv, ffn, vocab) in sizes.items():
        c = get_config(name)
        got = (c.hidden_size, c.num_layers, c.num_attention_heads, c.kv_heads)
        assert (*got, c.ffn_hidden_size, c.vocab_size) == (hidden, layers, heads, kv, ffn, vocab)
    assert get_config("llama3.2-1B").tie_word_embeddings
    assert get_config("qwen3-8B").head_dim == 128
    assert get_config("mistral-7B").sliding_window == 4096


def test_transformers_4_rope_scaling_spelling_reads_like_5():
    """Llama-3.1's published config.json (4.x: rope_scaling + rope_theta) and 5.x's
    rope_parameters give the same config; hf_config writes the 5.x spelling, never "default"."""
    published = {
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "bos_token_id": 128000,
        "eos_token_id": [128001, 128008, 128009],
    }
    old = config_from_hf(published)
    assert old.rope_scaling == get_config("llama3.1-8B").rope_scaling
    written = hf_config(old)
    assert written["rope_parameters"]["rope_type"] == "llama3"
    assert written["eos_token_id"] == [128001, 128008, 128009]
    new = config_from_hf({**written})
    assert new.rope_scaling == old.rope_scaling and new.rope_theta == 500000.0


def test_sliding_window_decode_over_rows_of_unequal_length():
    """Continuous batching: two rows of different lengths decode one token each in one step;
    the window is per row (its own slot), so each row's logits equal its full forward."""
    from models.kv_cache import KVCache

    torch.manual_seed(0)
    config = get_config("tiny-mistral")
    model = build_model(config, device="cpu").eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.mul_(6.0)  # std 0.12: attention far from uniform
    rows = [torch.randint(0, 256, (1, 21)), torch.randint(0, 256, (1, 13))]
    cache = KVCache.for_model(model, batch_size=2, max_seq_len=32)
    with torch.no_grad():
        for b, row in enumerate(rows):
            model(row[:, :-1], kv_cache=cache.rows(b, b + 1))
        last = torch.cat([row[:, -1:] for row in rows])
        step = model(last, kv_cache=cache)
        for b, row in enumerate(rows):
            full = model(row)[:, -1]
            assert (step[b, -1] - full[0]).abs().max().item() <= 1e-4, b


@pytest.mark.parametrize("kind", ["dynamic", "yarn"])
def test_scaled_rope_greedy_decode_equals_hf_generate(kind):
    """Past the original context (16) the KV-cache decode keeps transformers' RoPE: dynamic NTK
    grows its base with each step's longest position, as HF's does during `generate`."""
    scaling = {"type": kind, "factor": 2.0, "original_max_position_embeddings": 16}
    # HF's dynamic NTK reads max_position_embeddings as the pre-training length (the engine
    # serves factor times that); yarn's is the extended length.
    longest = 16 if kind == "dynamic" else 64
    config = get_config("tiny-llama", rope_scaling=scaling, max_position_embeddings=longest)
    hf = _randomised(hf_config(config), seed=4)
    ours = build_model(config, device="cpu").eval()
    ours.load_state_dict(from_hf(hf.state_dict(), config))
    ids = prompt(20, config.vocab_size, seed=6)
    expected = hf_generate(hf, ids, max_new_tokens=12, eos_token_id=None)
    engine = Engine(ours, TokenizerInfo(config.vocab_size, eos_id=None))
    [[greedy]] = engine.generate([ids], [SamplingConfig(max_new_tokens=12)])
    assert greedy.token_ids == expected[0, 20:].tolist()
