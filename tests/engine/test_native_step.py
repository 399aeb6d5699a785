"""The decode step in C (engine/native_step.py, engine/cpu_decode.c) against the lean step.

The C loop sums in another order than torch, so logits and the cache it writes must agree to
fp32 rounding (not bit for bit), greedy tokens must be the lean step's, and anything it does
not cover must go to the lean step.
"""

from __future__ import annotations

import copy
import platform
import shutil

import pytest
import torch

from engine import native_step
from engine.decode_step import DecodeStep
from engine.engine import Engine, EngineConfig
from engine.linear_choice import to_column_major
from engine.native_step import NativeStep
from engine.sampling import SamplingConfig
from engine.tokens import TokenizerInfo
from kernels.packed_linear import pack_linears
from models.kv_cache import KVCache
from tests.engine.test_decode_step import VOCAB
from tests.engine.test_decode_step import _model as _decode_step_model

BUILT, WHY = native_step.available()
needs_build = pytest.mark.skipif(not BUILT, reason=WHY)


def _model(**overrides) -> torch.nn.Module:
    """test_decode_step's model, with biases moved away from 0 as well."""
    return _decode_step_model(perturb=("norm", "bias"), **overrides)


def _prefilled(model, lengths: list[int], pad: int = 0) -> KVCache:
    """Row b holding a random prompt of lengths[b] tokens, the first `pad` of them padding."""
    cache = KVCache.for_model(model, len(lengths), 40)
    gen = torch.Generator().manual_seed(5)
    with torch.inference_mode():
        for b, n in enumerate(lengths):
            ids = torch.randint(0, VOCAB, (1, n), generator=gen)
            mask = torch.ones(1, n, dtype=torch.bool)
            mask[0, :pad] = False
            model(
                ids,
                kv_cache=cache.rows(b, b + 1),
                key_padding_mask_BS=mask if pad else None,
                logits_to_keep=1,
            )
    return cache


def _clone(cache: KVCache) -> KVCache:
    copy = KVCache.__new__(KVCache)
    copy.__dict__.update(cache.__dict__)
    copy.k_BSKD = {k: v.clone() for k, v in cache.k_BSKD.items()}
    copy.v_BSKD = {k: v.clone() for k, v in cache.v_BSKD.items()}
    copy.key_mask_BS = cache.key_mask_BS.clone()
    copy.lengths_B = cache.lengths_B.clone()
    return copy


def _one_step(native, reference, ours: KVCache, theirs: KVCache, ids_B1: torch.Tensor):
    """One decode step of `native` over `ours` and of `reference` over `theirs`: both logits."""
    step = ours.begin(1, None)
    got = native(ids_B1, ours, step)
    ours.commit(step)
    step = theirs.begin(1, None)
    want = reference(ids_B1, theirs, step)
    theirs.commit(step)
    return got, want


def _assert_close_steps(model, lengths=(6,), pad: int = 0, steps: int = 5) -> None:
    lean = DecodeStep(model)
    native, why = NativeStep.build(lean)
    assert native is not None, why
    ours = _prefilled(model, list(lengths), pad)
    theirs = _clone(ours)
    ids_B1 = torch.arange(7, 7 + len(lengths))[:, None]
    with torch.inference_mode():
        for _ in range(steps):
            got, want = _one_step(native, lean, ours, theirs, ids_B1)
            assert got.shape == want.shape == (len(lengths), VOCAB)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
            assert torch.equal(got.argmax(-1), want.argmax(-1))
            ids_B1 = want.argmax(-1, keepdim=True)
    for key in ours.k_BSKD:
        torch.testing.assert_close(ours.k_BSKD[key], theirs.k_BSKD[key], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours.v_BSKD[key], theirs.v_BSKD[key], rtol=1e-5, atol=1e-5)
    assert torch.equal(ours.lengths_B, theirs.lengths_B)


@needs_build
@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"qkv_bias": True},
        {"attention_bias": True, "mlp_bias": True},
        {"num_kv_heads": 4, "tie_word_embeddings": True},
        {"num_kv_heads": 1},
        {"rope_scaling": {"type": "linear", "factor": 2.0}},
    ],
    ids=["gqa", "qkv-bias", "all-biases", "mha-tied", "mqa", "linear-rope"],
)
@pytest.mark.parametrize(
    "lengths", [(6,), (5, 5, 5), (3, 9, 1, 6, 2, 4, 7, 5)], ids=["one", "even", "uneven-8"]
)
def test_logits_and_cache_match_the_lean_step(overrides, lengths):
    model = _model(**overrides)
    assert NativeStep(DecodeStep(model)).max_rows == native_step.C_ROWS  # row-major weights
    _assert_close_steps(model, lengths)


@needs_build
@pytest.mark.parametrize("lengths", [(9,), (9, 4)], ids=["one", "uneven"])
def test_padding_in_the_prompt_is_masked(lengths):
    _assert_close_steps(_model(), lengths, pad=3)


@needs_build
def test_packed_layers_with_their_dense_copy():
    model = _model()
    pack_linears(model, gemv_copy=True)
    assert NativeStep(DecodeStep(model)).max_rows == native_step.C_ROWS
    _assert_close_steps(model, (4, 6))


@needs_build
def test_column_major_weights():
    model = _model(qkv_bias=True)
    to_column_major(model)
    assert model.layers["0"].mlp.down_proj.weight.t().is_contiguous()
    assert NativeStep(DecodeStep(model)).max_rows == 1  # MKL runs several rows faster
    _assert_close_steps(model)
    step = NativeStep(DecodeStep(model))
    step.max_rows = 3  # the C product over column-major weights, 3 rows
    cache = _prefilled(model, [4, 2, 6])
    lean_cache = _clone(cache)
    ids = torch.tensor([[3], [4], [5]])
    with torch.inference_mode():
        got = step(ids, cache, cache.begin(1, None))
        want = DecodeStep(model)(ids, lean_cache, lean_cache.begin(1, None))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


@pytest.mark.parametrize(
    ("prepare", "reason"),
    [
        (lambda m: m, None),
        (lambda m: pack_linears(m), "plain"),  # packed only: no plain weights
        (lambda m: m.to(torch.float64), "fp32, bf16 or fp16"),
    ],
    ids=["covered", "packed-only", "fp64"],
)
def test_declines_what_it_does_not_cover(prepare, reason):
    model = _model()
    prepare(model)
    native, why = NativeStep.build(DecodeStep(model))
    if reason is None:
        assert (native is not None) == BUILT, why
    else:
        assert native is None and reason in why


def _rounded(cache: KVCache, dtype: torch.dtype) -> None:
    """Round a wide cache's keys and values to `dtype` values in place (as such a cache holds)."""
    for buffers in (cache.k_BSKD, cache.v_BSKD):
        for buf in buffers.values():
            buf.copy_(buf.to(dtype))


HALF = {"bf16": (torch.bfloat16, 2**-7), "fp16": (torch.float16, 2**-10)}
"""The 16-bit storage types the C step reads, with one step of their rounding (relative)."""


@needs_build
@pytest.mark.parametrize("half", list(HALF))
@pytest.mark.parametrize(
    "lengths", [(6,), (3, 9, 1, 6), tuple(range(1, 13))], ids=["one", "uneven-4", "uneven-12"]
)
def test_16_bit_model_reads_its_type_and_computes_in_fp32(lengths, half):
    """A bf16 or fp16 model: weights, norms, biases, embedding and cache are read in that type
    and widened, the arithmetic is fp32, and the new keys and values are rounded to it as they
    are written. Reference: the lean step on the same weights upcast to fp32 (exact), over the
    same cache upcast, rounded to the type after each step. The two differ only in that the C
    step attends over the new key/value already rounded, so logits agree closely and the cache
    rows written are the reference's rounded (within one step of the type)."""
    dtype, ulp = HALF[half]
    model = _model(qkv_bias=True).to(dtype)
    native, why = NativeStep.build(DecodeStep(model))
    assert native is not None, why
    assert native.max_rows == native_step.MAX_ROWS  # 16-bit: every step up to 64 rows in C
    wide = DecodeStep(_model(qkv_bias=True).to(dtype).float())
    ours = _prefilled(model, list(lengths))
    theirs = _clone(ours)
    theirs.k_BSKD = {k: v.float() for k, v in theirs.k_BSKD.items()}
    theirs.v_BSKD = {k: v.float() for k, v in theirs.v_BSKD.items()}
    ids_B1 = torch.arange(7, 7 + len(lengths))[:, None]
    with torch.inference_mode():
        for _ in range(5):
            got, want = _one_step(native, wide, ours, theirs, ids_B1)
            _rounded(theirs, dtype)
            assert got.dtype == torch.float32 and got.shape == want.shape
            torch.testing.assert_close(got, want, rtol=0, atol=1e-2 * want.abs().max().item())
            ids_B1 = want.argmax(-1, keepdim=True)
    for key in ours.k_BSKD:
        pairs = [(ours.k_BSKD[key], theirs.k_BSKD[key]), (ours.v_BSKD[key], theirs.v_BSKD[key])]
        for mine, ref in pairs:
            assert mine.dtype == dtype
            if key == "0":  # same input: the same value rounded (one step at a tie)
                torch.testing.assert_close(mine.float(), ref, rtol=ulp, atol=0)
            else:  # its input went through attention over the rounded key: two steps
                atol = 1e-2 * ref.abs().max().item()
                torch.testing.assert_close(mine.float(), ref, rtol=2 * ulp, atol=atol)


@needs_build
@pytest.mark.parametrize("half", list(HALF))
@pytest.mark.parametrize("shape", [(2, 7), (3, 1), (2, 40)], ids=["one-call", "one-token", "calls"])
def test_16_bit_prefill_in_c_matches_the_upcast_forward(shape, half):
    """`NativeStep.prefill`: prompts of a bf16 or fp16 model as rows of C calls (two 7-token
    prompts: one call of 14 rows over 2 cache rows; two 40-token prompts: calls of 64 and 16
    rows, the first ending inside the second prompt) against the model forward of the same
    weights upcast to fp32, from an empty cache: last-position logits close, the cache the
    forward wrote rounded to the type (one step in the first layer, whose input is the same;
    two after), lengths and mask alike."""
    dtype, ulp = HALF[half]
    model = _model(qkv_bias=True).to(dtype)
    wide = _model(qkv_bias=True).to(dtype).float()
    native = NativeStep(DecodeStep(model))
    rows, length = shape
    ids = torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(3))
    ours, theirs = KVCache.for_model(model, rows, 48), KVCache.for_model(wide, rows, 48)
    with torch.inference_mode():
        got = native.prefill(ids, ours)
        want = wide(ids, kv_cache=theirs, logits_to_keep=1)[:, -1]
    assert got is not None and got.shape == (rows, VOCAB) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=1e-2 * want.abs().max().item())
    assert ours.lengths_B.tolist() == theirs.lengths_B.tolist() == [length] * rows
    assert torch.equal(ours.key_mask_BS, theirs.key_mask_BS)
    for key in ours.k_BSKD:
        for mine, ref in (
            (ours.k_BSKD[key], theirs.k_BSKD[key]),
            (ours.v_BSKD[key], theirs.v_BSKD[key]),
        ):
            ref = ref.to(dtype).float()
            if key == "0":
                torch.testing.assert_close(mine.float(), ref, rtol=ulp, atol=0)
            else:
                atol = 1e-2 * ref.abs().max().item()
                torch.testing.assert_close(mine.float(), ref, rtol=2 * ulp, atol=atol)


@needs_build
def test_prefill_in_c_is_only_for_16_bit_models():
    """fp32 prefills keep the model forward (bit-identical to it), as do ring caches and more
    than MAX_ROWS prompts at once; the cache is left as it was."""
    fp32 = NativeStep(DecodeStep(_model()))
    cache = KVCache.for_model(_model(), 1, 40)
    assert fp32.prefill(torch.ones(1, 5, dtype=torch.long), cache) is None
    assert cache.lengths_B.tolist() == [0]
    bf16_model = _model().to(torch.bfloat16)
    bf16 = NativeStep(DecodeStep(bf16_model))
    ring = KVCache(bf16_model.layers.keys(), 1, 40, 2, 16, dtype=torch.bfloat16, window=4)
    assert bf16.prefill(torch.ones(1, 5, dtype=torch.long), ring) is None
    wide = KVCache.for_model(bf16_model, native_step.MAX_ROWS + 1, 8)
    assert bf16.prefill(torch.ones(native_step.MAX_ROWS + 1, 2, dtype=torch.long), wide) is None
    assert wide.lengths_B.sum().item() == 0


@needs_build
@pytest.mark.parametrize("half", list(HALF))
def test_16_bit_engine_steps_in_c_with_the_upcast_models_tokens(half):
    """The engine's default on a bf16 or fp16 model runs its decode steps in C, and its greedy
    tokens are those of the same weights upcast to fp32 (with peaked logits: no near-ties that
    the rounding of the prefill and the cache could flip). The 16-bit lean step rounds every
    intermediate and may part from both."""
    prompts = [[5, 9, 11], [7] * 8, [3, 4, 5, 6, 7, 8]]
    configs = [SamplingConfig(max_new_tokens=12) for _ in prompts]
    model = _model()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.mul_(10.0)
    narrow = model.to(HALF[half][0])
    tokens = {}
    for name, weights in ((half, narrow), ("fp32", copy.deepcopy(narrow).float())):
        engine = Engine(weights, TokenizerInfo(VOCAB), EngineConfig(max_batch_rows=3))
        assert isinstance(engine.runner.decode_step, NativeStep)
        assert engine.runner.decode_step.dtype == weights.embed_tokens.weight.dtype
        batch = [[r.token_ids for r in req] for req in engine.generate(prompts, configs)]
        alone = [
            engine.generate([p], [c])[0][0].token_ids for p, c in zip(prompts, configs, strict=True)
        ]
        tokens[name] = (batch, alone)
    assert tokens[half] == tokens["fp32"]


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({"fused_qkv": False}, "separate"),
        ({"fused_gate_up": False}, "separate"),
        ({"qk_norm": True}, "q/k norms"),
    ],
)
@needs_build
def test_declines_other_layer_layouts(overrides, reason):
    native, why = NativeStep.build(DecodeStep(_model(**overrides)))
    assert native is None and reason in why


def test_the_c_step_is_built_where_a_compiler_exists():
    """setuptools builds cpu_decode.c as an optional extension: on x86-64 with a C compiler (CI,
    the dev machine) a silent build failure would only show as slower decoding, and the tests
    above would skip."""
    if platform.machine() not in ("x86_64", "AMD64") or shutil.which("cc") is None:
        pytest.skip("checked where a C compiler exists on x86-64")
    assert native_step._compiled is not None


def test_without_the_build_the_lean_step_runs(monkeypatch):
    monkeypatch.setattr(native_step, "_compiled", None)
    native, why = NativeStep.build(DecodeStep(_model()))
    assert native is None and "not built" in why
    engine = Engine(_model(), TokenizerInfo(VOCAB), EngineConfig(cpu_linear="dense"))
    assert type(engine.runner.decode_step) is DecodeStep


@needs_build
def test_rows_beyond_max_rows_go_to_the_lean_step():
    model = _model()
    native = NativeStep(DecodeStep(model))
    native.max_rows = 1
    calls = []
    native.lean = lambda ids, cache, step: calls.append(ids.shape[0]) or torch.zeros(2, VOCAB)
    cache = KVCache.for_model(model, 2, 16)
    with torch.inference_mode():
        native(torch.tensor([[1], [2]]), cache, cache.begin(1, None))
    assert calls == [2]


@needs_build
def test_the_compiled_call_checks_its_arguments():
    native = NativeStep(DecodeStep(_model()))
    logits, scratch = torch.empty(2, VOCAB), torch.empty(4096)
    tokens, positions = torch.tensor([3, VOCAB]), torch.tensor([0, 0])
    ptrs = (tokens.data_ptr(), positions.data_ptr(), 0, 0, logits.data_ptr(), scratch.data_ptr())
    with pytest.raises(ValueError, match="row 1 has token 96"):
        native_step._compiled.step(native._model_addr, 2, *ptrs, 1)  # id == vocab size
    with pytest.raises(ValueError, match="rows outside"):
        native_step._compiled.step(native._model_addr, 65, *ptrs, 1)
    with pytest.raises(ValueError, match="null"):
        native_step._compiled.step(0, 1, *ptrs, 1)
    cache_rows, valid = torch.tensor([0, native_step.MAX_ROWS]), torch.tensor([3, 4])
    ok = (valid.data_ptr(), *ptrs[1:])
    with pytest.raises(ValueError, match="row 1 names cache row 64"):
        native_step._compiled.step(native._model_addr, 2, *ok, 1, cache_rows.data_ptr())
    cache = KVCache.for_model(_model(), 1, 8)
    with pytest.raises(ValueError, match="1 rows x 8 slots for 2 rows"):
        native(torch.tensor([[1], [2]]), cache, cache.begin(1, None))


@needs_build
@pytest.mark.parametrize("cpu_linear", ["auto", "dense", "colmajor", "packed+gemv"])
def test_engine_default_runs_steps_in_c_with_the_lean_steps_tokens(cpu_linear):
    """Lone requests (batch-1 steps) and a batch whose rows finish one by one, greedy, sampled
    and with log-probabilities: the same tokens as `--decode-step lean`, log-probabilities to
    fp32 rounding."""
    prompts = [[5, 9, 11], [7] * 8, [3, 4, 5, 6, 7, 8]]
    configs = [
        SamplingConfig(max_new_tokens=12, logprobs=2),
        SamplingConfig(max_new_tokens=5, do_sample=True, top_p=0.9, seed=4),
        SamplingConfig(max_new_tokens=9, repetition_penalty=1.3),
    ]
    results = {}
    for decode_step in ("auto", "lean"):
        config = EngineConfig(max_batch_rows=3, cpu_linear=cpu_linear, decode_step=decode_step)
        engine = Engine(_model(), TokenizerInfo(VOCAB), config)
        assert isinstance(engine.runner.decode_step, NativeStep) == (decode_step == "auto")
        if decode_step == cpu_linear == "auto":  # a layout that keeps row-major weights
            assert engine.cpu_linear in ("dense", "packed+gemv")
        alone = [engine.generate([p], [c])[0] for p, c in zip(prompts, configs, strict=True)]
        results[decode_step] = (alone, engine.generate(prompts, configs))
    for ours, lean in zip(results["auto"], results["lean"], strict=True):
        for got, want in zip(ours, lean, strict=True):
            assert [r.token_ids for r in got] == [r.token_ids for r in want]
            for g, w in zip(got, want, strict=True):
                assert g.cumulative_logprob == pytest.approx(w.cumulative_logprob, abs=1e-4)


@needs_build
def test_under_the_c_step_the_layout_probe_times_a_larger_step(monkeypatch):
    from engine import linear_choice

    seen = []

    def spy(times, allow_copy=False, row_major=False):
        seen.append((sorted({rows for _, rows in times}), sorted({k for k, _ in times}), row_major))
        return "dense"

    monkeypatch.setattr(linear_choice, "pick_layout", spy)
    linear_choice.choose_cpu_linear(_model(), c_rows=native_step.C_ROWS)
    linear_choice.choose_cpu_linear(_model())
    assert seen == [
        ([4 * native_step.C_ROWS], ["dense", "packed"], True),  # column-major is no candidate
        ([1, 8], ["colmajor", "dense", "packed"], False),
    ]
