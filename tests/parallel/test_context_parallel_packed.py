"""Context parallelism with packed documents and padding: ring attention and a CP2 model equal
their one-process counterparts (forward and backward).

Documents cross the chunk boundaries (so earlier key chunks hold parts of a query's document),
rows end in padding (segment 0, masked keys: those queries see nothing and give zeros), and
position ids restart per document, computed on the whole sequence before sharding.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from kernels.attention import attention
from parallel.context_parallel import ring_attention, shard_sequence
from tests.harness import run_distributed

S = 32
# Two rows: documents of 5, 13, 9 tokens then 5 of padding; one document of 29 then padding.
SEGMENTS = torch.tensor(
    [[1] * 5 + [2] * 13 + [3] * 9 + [0] * 5, [1] * 29 + [0] * 3], dtype=torch.long
)


def _ring_diffs(rank: int, cp: int, alibi: bool) -> list[float]:
    torch.manual_seed(0)
    q = torch.randn(2, S, 4, 8, requires_grad=True)
    k = torch.randn(2, S, 2, 8, requires_grad=True)
    v = torch.randn(2, S, 2, 8, requires_grad=True)
    real = SEGMENTS > 0
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625]) if alibi else None
    masks = dict(key_padding_mask_BS=real, segment_ids_BS=SEGMENTS, alibi_slopes_H=slopes)
    ref = attention(q, k, v, causal=True, **masks)
    ref.square().sum().backward()
    local = [shard_sequence(t.detach(), rank, cp).requires_grad_() for t in (q, k, v)]
    out = ring_attention(
        *local,
        dist.group.WORLD,
        alibi_slopes_H=slopes,
        key_padding_mask_BS=shard_sequence(real, rank, cp),
        segment_ids_BS=shard_sequence(SEGMENTS, rank, cp),
    )
    out.square().sum().backward()
    diffs = [float((out - shard_sequence(ref.detach(), rank, cp)).abs().max())]
    for mine, full in zip(local, (q, k, v), strict=True):
        diffs.append(float((mine.grad - shard_sequence(full.grad, rank, cp)).abs().max()))
    return diffs


def _model_diffs(rank: int, cp: int) -> dict[str, float]:
    from models.registry import get_config
    from models.transformer import build_model, positions_from_segments
    from parallel.context_parallel import apply_context_parallel
    from parallel.tensor_parallel import tp_cross_entropy_sum

    config = get_config("tiny-llama-gqa")
    gen = torch.Generator().manual_seed(0)
    ids, labels = torch.randint(0, 256, (2, 2, S), generator=gen)
    mask = (SEGMENTS > 0).float()
    pos = positions_from_segments(SEGMENTS)
    batch = dict(position_ids_BS=pos, segment_ids_BS=SEGMENTS)
    ref = build_model(config, "cpu")
    ref.init_weights(seed=1)
    ref_loss = tp_cross_entropy_sum(ref(ids, **batch), labels, mask)
    ref_loss.backward()
    model = build_model(config, "cpu")
    model.init_weights(seed=1)
    apply_context_parallel(model, dist.group.WORLD)
    local = {name: shard_sequence(t, rank, cp) for name, t in batch.items()}
    loss = tp_cross_entropy_sum(
        model(shard_sequence(ids, rank, cp), **local),
        shard_sequence(labels, rank, cp),
        shard_sequence(mask, rank, cp),
    )
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    out = {"loss": abs(float(total) - float(ref_loss)) / abs(float(ref_loss))}
    for (name, p), (_, q) in zip(ref.named_parameters(), model.named_parameters(), strict=True):
        grad = q.grad.clone()
        dist.all_reduce(grad)  # CP ranks hold disjoint tokens: their gradients add up
        out[name] = float((p.grad - grad).abs().max() / p.grad.abs().max())
    return out


def _body(rank: int, cp: int) -> dict:
    return {
        "ring": _ring_diffs(rank, cp, alibi=False),
        "ring-alibi": _ring_diffs(rank, cp, alibi=True),
        "model": _model_diffs(rank, cp),
    }


@pytest.mark.dist
def test_packed_and_padded_batches_match_one_process():
    for result in run_distributed(_body, 2):
        # fp32, different summation order only (as test_ring_attention / test_tensor_parallel).
        assert max(result["ring"]) < 1e-5, result["ring"]
        assert max(result["ring-alibi"]) < 1e-5, result["ring-alibi"]
        worst = max(result["model"], key=result["model"].get)
        assert result["model"][worst] < 1e-5, (worst, result["model"][worst])


def test_reused_segment_id_is_refused():
    from parallel.context_parallel import _cross_chunk_masks

    keys = torch.tensor([[1, 1, 2, 2]])
    queries = torch.tensor([[1, 1, 2, 2]])  # document 1 again after document 2
    with pytest.raises(ValueError, match="one run of positions"):
        _cross_chunk_masks(torch.ones(1, 4, dtype=torch.bool), keys, queries, same_chunk=False)
