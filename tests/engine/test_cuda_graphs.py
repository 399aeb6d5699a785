"""CUDA-graph decode: the static step equals the eager one; graphed engines decode as eager ones.

On CPU the graphs are not captured (`capture=False` runs the same static step directly), which
checks the step itself, the buckets and the engine's bookkeeping; the `gpu` test captures real
CUDA graphs and compares a graphed engine's greedy tokens with an eager one's.
"""

from __future__ import annotations

import pytest
import torch

from engine import cuda_graphs
from engine.cuda_graphs import GraphedDecode, slot_bucket
from engine.decode_step import DecodeStep
from engine.engine import Engine, EngineConfig
from engine.sampling import SamplingConfig
from engine.tokens import TokenizerInfo
from models.kv_cache import KVCache
from tests.engine.test_decode_step import VOCAB, _model, _prefilled


def test_slot_bucket_is_the_smallest_power_of_two_that_holds_the_step() -> None:
    assert slot_bucket(1, 4096) == 256
    assert slot_bucket(256, 4096) == 256
    assert slot_bucket(257, 4096) == 512
    assert slot_bucket(3000, 4096) == 4096
    assert slot_bucket(90, 100) == 100  # capped at the cache's slots
    with pytest.raises(ValueError, match="key_len=101"):
        slot_bucket(101, 100)


@pytest.mark.parametrize("lengths", [[5, 5, 5], [3, 9, 1]])
def test_static_step_matches_the_eager_step_and_commits_the_same_cache(
    lengths: list[int],
) -> None:
    """Rows of equal and unequal length, three steps, a 16-slot bucket over a 32-slot cache."""
    model = _model()
    decode = DecodeStep(model)
    ours, theirs = _prefilled(model, lengths), _prefilled(model, lengths)
    ids_B1 = torch.randint(0, VOCAB, (len(lengths), 1), generator=torch.Generator().manual_seed(9))
    with torch.inference_mode():
        for _ in range(3):
            got = decode.static(ids_B1, ours, len(lengths), 16)
            step = theirs.begin(1, None)
            want = decode(ids_B1, theirs, step)
            theirs.commit(step)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            ids_B1 = want.argmax(-1, keepdim=True)
    assert torch.equal(ours.lengths_B, theirs.lengths_B)
    assert torch.equal(ours.key_mask_BS, theirs.key_mask_BS)
    for key in ours.k_BSKD:
        for b, n in enumerate(ours.lengths_B.tolist()):
            torch.testing.assert_close(ours.k_BSKD[key][b, :n], theirs.k_BSKD[key][b, :n])
            torch.testing.assert_close(ours.v_BSKD[key][b, :n], theirs.v_BSKD[key][b, :n])


def test_static_step_reads_only_the_first_rows() -> None:
    """Rows past B (idle pool rows) are neither read nor written."""
    model = _model()
    cache = _prefilled(model, [4, 6, 2])
    before = {key: buf[2].clone() for key, buf in cache.k_BSKD.items()}
    with torch.inference_mode():
        DecodeStep(model).static(torch.tensor([[1], [2]]), cache, 2, 16)
    assert cache.lengths_B.tolist() == [5, 7, 2]
    assert all(torch.equal(cache.k_BSKD[key][2], before[key]) for key in before)


def _requests() -> tuple[list[list[int]], list[SamplingConfig]]:
    """Prompts of several lengths and budgets, so rows leave at different steps and the row
    count and slot bucket both change during the run."""
    gen = torch.Generator().manual_seed(3)
    lengths, budgets = [3, 11, 6, 17, 1], [20, 7, 30, 12, 25]
    prompts = [torch.randint(4, VOCAB, (n,), generator=gen).tolist() for n in lengths]
    return prompts, [SamplingConfig(max_new_tokens=m) for m in budgets]


def _engine(model, **config) -> Engine:
    return Engine(model, TokenizerInfo(VOCAB), EngineConfig(max_batch_rows=8, **config))


class _DenseEngine(Engine):
    """An engine with dense cache rows, as CUDA graphs run on (a CPU engine pages its cache)."""

    pages_kv = False


def _dense_engine(model) -> Engine:
    return _DenseEngine(model, TokenizerInfo(VOCAB), EngineConfig(max_batch_rows=8))


def test_engine_with_uncaptured_graph_steps_decodes_as_the_eager_engine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cuda_graphs, "MIN_BUCKET", 8)  # buckets 8, 16, 32, 64 on this context
    prompts, configs = _requests()
    eager = _dense_engine(_model())
    graphed = _dense_engine(_model())
    assert graphed.runner.decode_step is not None
    graphed.runner.graphs = GraphedDecode(
        graphed.runner.decode_step, graphed.pool.cache, capture=False
    )
    want = eager.generate(prompts, configs)
    got = graphed.generate(prompts, configs)
    assert [r[0].token_ids for r in got] == [r[0].token_ids for r in want]
    assert {slots for _, slots in graphed.runner.graphs.graphs} == {32, 64}
    assert len({rows for rows, _ in graphed.runner.graphs.graphs}) > 1


def test_graphs_are_bounded_least_recently_used_first_out() -> None:
    model = _model()
    cache = KVCache.for_model(model, 4, 32)
    graphs = GraphedDecode(DecodeStep(model), cache, capture=False, max_graphs=2)
    with torch.inference_mode():
        for rows in (1, 2, 1, 3):
            graphs(torch.zeros(rows, 1, dtype=torch.long), cache.lengths_B[:rows].tolist())
    assert list(graphs.graphs) == [(1, 32), (3, 32)]


def test_rings_keep_the_eager_step() -> None:
    ring = KVCache.for_model(_model(sliding_window=8), 2)
    assert ring.is_ring
    with pytest.raises(ValueError, match="rings"):
        GraphedDecode(DecodeStep(_model()), ring, capture=False)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_captured_graphs_decode_as_the_eager_engine_on_cuda(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    """Real CUDA graphs: greedy tokens identical to eager steps (fp32 with TF32 off; in bf16 the
    first tokens, before near-ties on random weights can flip), over changing rows and buckets."""
    monkeypatch.setattr(cuda_graphs, "MIN_BUCKET", 8)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    prompts, configs = _requests()
    eager = _engine(_model("cuda").to(dtype), enforce_eager=True)
    graphed = _engine(_model("cuda").to(dtype))
    assert eager.runner.graphs is None and graphed.runner.graphs is not None
    want = [r[0].token_ids for r in eager.generate(prompts, configs)]
    got = [r[0].token_ids for r in graphed.generate(prompts, configs)]
    assert graphed.runner.graphs.captures >= 4
    if dtype == torch.float32:
        assert got == want
    else:
        assert [g[:3] for g in got] == [w[:3] for w in want]
