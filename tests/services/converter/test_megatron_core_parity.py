"""Our Megatron files run in megatron-core (on CPU, with three small stand-ins for the places where
it assumes CUDA: RoPE frequencies, the attention score buffer, the RNG tracker): an HF Llama (GQA) converted to the legacy layout is
loaded into megatron-core's GPTModel (local spec) under Megatron's legacy→mcore renames only
(query_key_value → linear_qkv, dense_h_to_4h → linear_fc1, ...), and its logits match
transformers'. This checks the interleaved QKV groups, the [gate; up] fc1 and the vocabulary
padding against Megatron's own model code, not against our reading of it."""

from __future__ import annotations

import contextlib
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.harness import run_distributed

# fp32 on CPU; the two implementations differ only in op order (RoPE, softmax, norms).
ATOL = 1e-4

_MCORE_NAMES = (
    (r"^embedding\.word_embeddings\.weight$", "embedding.word_embeddings.weight"),
    (r"^encoder\.layers\.(\d+)\.input_norm\.weight$", r"decoder.layers.\1.input_layernorm.weight"),
    (
        r"^encoder\.layers\.(\d+)\.self_attention\.query_key_value\.weight$",
        r"decoder.layers.\1.self_attention.linear_qkv.weight",
    ),
    (
        r"^encoder\.layers\.(\d+)\.self_attention\.dense\.weight$",
        r"decoder.layers.\1.self_attention.linear_proj.weight",
    ),
    (
        r"^encoder\.layers\.(\d+)\.post_attention_norm\.weight$",
        r"decoder.layers.\1.pre_mlp_layernorm.weight",
    ),
    (
        r"^encoder\.layers\.(\d+)\.mlp\.dense_h_to_4h\.weight$",
        r"decoder.layers.\1.mlp.linear_fc1.weight",
    ),
    (
        r"^encoder\.layers\.(\d+)\.mlp\.dense_4h_to_h\.weight$",
        r"decoder.layers.\1.mlp.linear_fc2.weight",
    ),
    (r"^encoder\.final_norm\.weight$", "decoder.final_layernorm.weight"),
    (r"^output_layer\.weight$", "output_layer.weight"),
)


def _to_mcore(name: str) -> str:
    for pattern, replacement in _MCORE_NAMES:
        if re.match(pattern, name):
            return re.sub(pattern, replacement, name)
    raise AssertionError(f"no megatron-core name for {name}")


def _keep_rope_on_cpu() -> None:
    """megatron-core's RotaryEmbedding.get_emb moves its frequencies to the current CUDA device
    unconditionally; this is the same body (non-interleaved RoPE) without that move."""
    from megatron.core.models.common.embeddings import rotary_pos_embedding as rope

    def get_emb(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        assert not self.rotary_interleaved
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)
        return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]

    rope.RotaryEmbedding.get_emb = get_emb


def _cpu_attention_buffer() -> None:
    """Local attention takes its score buffer from a global pool that allocates on CUDA; a CPU
    buffer placed in the pool first (large enough for this test) is used instead."""
    from megatron.core import parallel_state

    pool = parallel_state.get_global_memory_buffer()
    pool.buffer[("mpu", torch.float32)] = torch.empty(1 << 16, dtype=torch.float32)


class _NoRngFork:
    """Stands in for megatron-core's CUDA RNG tracker: dropout is 0, so no RNG state matters."""

    def fork(self, *args: object, **kwargs: object) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


def _mcore_logits(rank: int, world_size: int, checkpoint: str, ids: np.ndarray) -> np.ndarray:
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from checkpoints.megatron_format import _flatten, load_file

    parallel_state.initialize_model_parallel(1, 1)
    _keep_rope_on_cpu()
    _cpu_attention_buffer()
    from megatron.core import tensor_parallel

    tensor_parallel.get_cuda_rng_tracker = _NoRngFork
    state = load_file(Path(checkpoint) / "release" / "mp_rank_00" / "model_optim_rng.pt")
    args = state["args"]
    config = TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        ffn_hidden_size=args.ffn_hidden_size,
        normalization=args.normalization,
        layernorm_epsilon=args.norm_epsilon,
        gated_linear_unit=args.swiglu,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=args.add_bias_linear,
        use_cpu_initialization=True,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    model = GPTModel(
        config,
        get_gpt_layer_local_spec(normalization=args.normalization),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        position_embedding_type="rope",
        rotary_base=int(args.rotary_base),
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
    ).eval()
    weights = {_to_mcore(n): t for n, t in _flatten(state["model"]).items()}
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing), missing
    tokens = torch.from_numpy(ids)
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    # Megatron's mask convention: True = masked out (given explicitly; its default lives on CUDA).
    causal = torch.triu(torch.ones(tokens.shape[1], tokens.shape[1], dtype=torch.bool), 1)
    with torch.no_grad():
        logits = model(tokens, positions, attention_mask=causal[None, None])
    return logits.float().numpy()


@pytest.mark.dist
def test_megatron_core_runs_our_checkpoint(tmp_path):
    from transformers import AutoModelForCausalLM

    from services.converter.job import ConvertOptions, convert
    from tests.services.converter.conftest import VOCAB, hf_llama_gqa, save_hf

    hf_dir = save_hf(hf_llama_gqa(num_layers=2), tmp_path / "hf")
    convert(ConvertOptions("hf", "megatron", hf_dir, tmp_path / "mg"))
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    mcore = torch.from_numpy(
        run_distributed(_mcore_logits, 1, str(tmp_path / "mg"), ids.numpy())[0]
    )
    assert mcore.shape[-1] == 256  # padded vocabulary; the padding rows are zeros
    assert not mcore[..., VOCAB:].any()
    with torch.no_grad():
        reference = AutoModelForCausalLM.from_pretrained(hf_dir).eval()(ids).logits
    torch.testing.assert_close(mcore[..., :VOCAB], reference, atol=ATOL, rtol=0)
