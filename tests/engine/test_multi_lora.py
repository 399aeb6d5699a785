"""Many LoRA adapters in one batch: each request gets exactly the greedy tokens of its own
merged model (peft's merge_and_unload, run by HF generate), adapters of any rank and targets
side by side with base-model rows; adapters that do not fit are refused at load."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model

from engine.config import EngineConfig
from engine.engine import Engine
from engine.lora_files import check_adapter_config
from engine.sampling import SamplingConfig
from engine.tokens import TokenizerInfo
from engine.validation import InvalidRequest
from tests.services.inference.helpers import EOS_ID, hf_generate, hf_reference, prompt

ADAPTERS = {
    # name: (rank, alpha, peft target modules)
    "qv": (4, 8, ["q_proj", "v_proj"]),
    "all": (8, 16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "mlp": (2, 4, ["o_proj", "down_proj", "up_proj"]),
}


def save_adapter(hf, directory, rank, alpha, targets, seed):
    """A peft LoRA adapter of `hf` with random A and B (B large enough to change the tokens)."""
    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights=False)
    peft_model = get_peft_model(copy.deepcopy(hf), config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.mul_(3.0)
    peft_model.save_pretrained(str(directory))
    return directory


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    hf, ours, config = hf_reference("llama-gqa")
    root = tmp_path_factory.mktemp("adapters")
    dirs = {
        name: save_adapter(hf, root / name, r, a, t, seed)
        for seed, (name, (r, a, t)) in enumerate(ADAPTERS.items())
    }
    engine = Engine(
        ours,
        TokenizerInfo(config.vocab_size),
        EngineConfig(enable_lora=True, max_loras=3, max_lora_rank=8, max_batch_rows=16),
    )
    for name, directory in dirs.items():
        engine.install_adapter(engine.adapters.prepare(name, directory, "test"), "test")
    return hf, engine, config, dirs


def merged(hf, directory):
    return PeftModel.from_pretrained(copy.deepcopy(hf), str(directory)).merge_and_unload().eval()


def test_mixed_batch_equals_each_merged_model(served):
    hf, engine, config, dirs = served
    greedy = SamplingConfig(max_new_tokens=10)
    # Same-length prompts share one prefill across adapters; others prefill apart.
    requests = [
        ("qv", prompt(7, config.vocab_size, 1)),
        ("all", prompt(7, config.vocab_size, 2)),
        ("", prompt(7, config.vocab_size, 3)),
        ("mlp", prompt(5, config.vocab_size, 4)),
        ("all", prompt(9, config.vocab_size, 5)),
        ("qv", prompt(5, config.vocab_size, 6)),
        ("", prompt(4, config.vocab_size, 7)),
        ("mlp", prompt(7, config.vocab_size, 8)),
    ]
    results = engine.generate(
        [p for _, p in requests], [greedy] * len(requests), [a for a, _ in requests]
    )
    references = {name: merged(hf, d) for name, d in dirs.items()}
    references[""] = hf
    changed = 0
    for (adapter, ids), result in zip(requests, results, strict=True):
        expected = hf_generate(references[adapter], ids, max_new_tokens=10)[0, len(ids) :]
        assert result[0].token_ids == expected.tolist(), adapter
        if adapter:
            base = hf_generate(hf, ids, max_new_tokens=10)[0, len(ids) :]
            changed += base.tolist() != expected.tolist()
    assert changed >= 4  # the adapters do change the tokens (the test can fail)


def test_base_rows_beside_adapters_keep_their_tokens(served):
    _hf, engine, config, _ = served
    greedy = SamplingConfig(max_new_tokens=8)
    ids = prompt(6, config.vocab_size, 11)
    alone = engine.generate([ids], [greedy])[0][0].token_ids
    mixed = engine.generate([ids, ids, ids], [greedy] * 3, ["", "all", "qv"])
    assert mixed[0][0].token_ids == alone
    assert mixed[1][0].token_ids != alone


@pytest.fixture(scope="module")
def chunked(served):
    """An engine of the same weights and adapters with the paged cache's prefix caching on and
    a step budget of 40 tokens, so prompts prefill in chunks between decode steps."""
    hf, _, config, dirs = served
    _, ours, _ = hf_reference("llama-gqa")
    engine = Engine(
        ours,
        TokenizerInfo(config.vocab_size),
        EngineConfig(
            enable_lora=True,
            max_loras=3,
            max_lora_rank=8,
            max_batch_rows=8,
            max_num_batched_tokens=40,
        ),
    )
    assert engine.runner.paged and engine.runner.prefix_caching
    for name, directory in dirs.items():
        engine.install_adapter(engine.adapters.prepare(name, directory, "test"), "test")
    return hf, engine, config, dirs


def test_prefix_cache_and_chunked_prefill_keep_each_adapter_exact(chunked):
    hf, engine, config, dirs = chunked
    greedy = SamplingConfig(max_new_tokens=8)
    system = prompt(45, config.vocab_size, 21)  # two full 16-token blocks to share, and more
    names = ["qv", "all", "", "mlp"]
    stats = engine.pool.blocks.stats
    hits_before = stats.hit_tokens
    rounds = []
    for seed in (1, 2):  # the second round finds the first round's blocks, each in its own name
        prompts = [system + prompt(3 + i, config.vocab_size, 30 * seed + i) for i in range(4)]
        results = engine.generate(prompts, [greedy] * 4, names)
        rounds.append((prompts, results))
        hits = stats.hit_tokens - hits_before
        assert hits == (0 if seed == 1 else 4 * 32), hits
    references = {name: merged(hf, d) for name, d in dirs.items()}
    references[""] = hf
    for prompts, results in rounds:
        for name, ids, result in zip(names, prompts, results, strict=True):
            expected = hf_generate(references[name], ids, max_new_tokens=8)[0, len(ids) :]
            assert result[0].token_ids == expected.tolist(), name
    assert engine.pool.blocks.used == 0 and engine.pool.blocks.reserved == 0


def test_same_prompt_under_two_adapters_shares_no_block(chunked):
    _, engine, config, dirs = chunked
    greedy = SamplingConfig(max_new_tokens=2)
    ids = prompt(33, config.vocab_size, 77)  # two full blocks before the last token
    stats = engine.pool.blocks.stats

    def hits(adapter: str) -> int:
        before = stats.hit_tokens
        engine.generate([ids], [greedy], [adapter])
        return stats.hit_tokens - before

    assert [hits("qv"), hits("all"), hits(""), hits("mlp")] == [0, 0, 0, 0]
    assert [hits("qv"), hits("all"), hits(""), hits("mlp")] == [32, 32, 32, 32]
    # Unloaded and loaded again under its name (here with other weights): a new namespace.
    engine.remove_adapter("mlp", "unload")
    engine.install_adapter(engine.adapters.prepare("mlp", dirs["qv"], "load"), "load")
    assert hits("mlp") == 0 and hits("mlp") == 32


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculation_verifies_with_each_rows_adapter(tmp_path, method):
    """Speculative decoding with adapters: every draft (prompt lookup, or a draft model that
    knows no adapter) is verified by the target with the row's own adapter, so greedy tokens
    equal each merged model's HF generate, token for token, while drafts are accepted (a
    32-token vocabulary makes the random model repeat itself, so n-grams are found)."""
    from pathlib import Path

    from engine.speculative_config import SpeculativeConfig

    hf, ours, config = hf_reference("llama-gqa", seed=3, vocab_size=32)
    dirs = {
        name: save_adapter(hf, tmp_path / name, r, a, t, seed)
        for seed, (name, (r, a, t)) in enumerate(ADAPTERS.items())
    }
    spec = SpeculativeConfig(method, 3, 3, 1, model=Path(".") if method == "draft_model" else None)
    draft = copy.deepcopy(ours) if method == "draft_model" else None
    engine = Engine(
        ours,
        TokenizerInfo(config.vocab_size, eos_id=EOS_ID),
        EngineConfig(
            enable_lora=True, max_loras=3, max_lora_rank=8, max_batch_rows=8,
            speculative_config=spec,
        ),
        draft_model=draft,
    )  # fmt: skip
    for name, directory in dirs.items():
        engine.install_adapter(engine.adapters.prepare(name, directory, "test"), "test")
    requests = [("qv", prompt(6, 32, 31)), ("all", prompt(9, 32, 32)), ("", prompt(5, 32, 33))]
    requests.append(("mlp", prompt(7, 32, 34)))
    greedy = SamplingConfig(max_new_tokens=40)
    results = engine.generate(
        [p for _, p in requests], [greedy] * len(requests), [a for a, _ in requests]
    )
    references = {name: merged(hf, d) for name, d in dirs.items()}
    references[""] = hf
    changed = 0
    for (adapter, ids), result in zip(requests, results, strict=True):
        expected = hf_generate(references[adapter], ids, max_new_tokens=40)[0, len(ids) :]
        expected = expected.tolist()
        if EOS_ID in expected:  # HF pads after EOS
            expected = expected[: expected.index(EOS_ID) + 1]
        assert result[0].token_ids == expected, adapter
        if adapter:
            changed += hf_generate(hf, ids, max_new_tokens=40)[0, len(ids) :].tolist() != expected
    assert changed >= 2  # the adapters change the tokens: the base model would not pass
    stats = engine.speculation.stats
    assert 0 < stats.accepted < stats.drafted, stats  # drafts kept and drafts rolled back


def test_unknown_adapter_is_refused_naming_it(served):
    _, engine, _config, _ = served
    with pytest.raises(InvalidRequest, match="'nope'") as info:
        engine.submit([5, 6], SamplingConfig(max_new_tokens=2), "nope")
    assert info.value.problems[0].field == "model"


def test_rank_over_max_lora_rank_is_refused_before_weights(served, tmp_path):
    hf, engine, _, _ = served
    directory = save_adapter(hf, tmp_path / "big", 16, 16, ["q_proj"], 9)
    (directory / "adapter_model.safetensors").write_bytes(b"not read")
    with pytest.raises(ValueError, match="rank 16 is over --max-lora-rank 8"):
        engine.adapters.prepare("big", directory, "--lora-modules")


def test_target_outside_the_served_layers_is_refused(served, tmp_path):
    hf, engine, _, _ = served
    directory = save_adapter(hf, tmp_path / "head", 4, 8, ["lm_head"], 9)
    with pytest.raises(ValueError, match=r"targets \['lm_head'\]"):
        engine.adapters.prepare("head", directory, "load")


def test_adapter_of_another_model_is_refused(served, tmp_path):
    _, engine, _, _ = served
    other, _, _ = hf_reference("llama-gqa", hidden_size=128, ffn_hidden_size=256)
    directory = save_adapter(other, tmp_path / "other", 4, 8, ["q_proj"], 3)
    with pytest.raises(ValueError, match="trained on another model"):
        engine.adapters.prepare("other", directory, "load")


def test_adapter_file_larger_than_any_fitting_adapter_is_refused_unread(served, tmp_path):
    import shutil

    _, engine, _, dirs = served
    directory = tmp_path / "big"
    shutil.copytree(dirs["qv"], directory)
    weights = directory / "adapter_model.safetensors"
    limit = 8 * engine.adapters.lora.adapter_elements() + (1 << 20)
    with weights.open("r+b") as f:  # sparse: the size a header would claim, never read
        f.truncate(limit + 1)
    with pytest.raises(ValueError, match=r"load: adapter_model.safetensors is \d+ bytes, more"):
        engine.adapters.prepare("big", directory, "load")


def test_slots_are_bounded_and_unload_frees_one(served, tmp_path):
    _, engine, _, dirs = served
    again = engine.adapters.prepare("qv2", dirs["qv"], "load")
    with pytest.raises(ValueError, match="all --max-loras 3 adapter slots are in use"):
        engine.install_adapter(again, "load")
    engine.remove_adapter("mlp", "unload")
    with pytest.raises(InvalidRequest, match="'mlp'"):
        engine.submit([5, 6], SamplingConfig(max_new_tokens=2), "mlp")
    engine.install_adapter(again, "load")
    assert set(engine.adapters.names()) == {"qv", "all", "qv2"}
    engine.remove_adapter("qv2", "unload")
    engine.install_adapter(engine.adapters.prepare("mlp", dirs["mlp"], "load"), "load")


def test_config_check_reads_no_weight(tmp_path):
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
    assert check_adapter_config(tmp_path, 8, "x")["r"] == 4
    with pytest.raises(ValueError, match="not an existing adapter directory"):
        check_adapter_config(tmp_path / "missing", 8, "--lora-modules")
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "IA3", "r": 4}))
    with pytest.raises(ValueError, match="only plain LoRA"):
        check_adapter_config(tmp_path, 8, "x")


@pytest.mark.slow
def test_smollm2_mixed_adapter_batch_equals_peft_merged_models(smollm2_dir, tmp_path):
    """The real SmolLM2-135M-Instruct (registry GGUF through transformers): a base row and two
    adapters of other ranks and targets in one batch give each the greedy tokens of its own
    peft-merged model under HF generate."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.build import build_engine
    from engine.config import LoadSpec

    hf = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir))
    dirs = {
        "qv": save_adapter(hf, tmp_path / "qv", 4, 8, ["q_proj", "v_proj"], 0),
        "mlp": save_adapter(hf, tmp_path / "mlp", 8, 16, ["o_proj", "down_proj", "k_proj"], 1),
    }
    config = EngineConfig(
        max_batch_rows=4, max_model_len=256, enable_lora=True, max_loras=2, max_lora_rank=8
    )
    _, engine = build_engine(LoadSpec(smollm2_dir, "hf", None), config, device=torch.device("cpu"))
    for name, directory in dirs.items():
        engine.install_adapter(engine.adapters.prepare(name, directory, "test"), "test")
    ids = tokenizer.encode("The capital of France is")
    tokens: dict[int, list[int]] = {}
    order = [engine.submit(ids, SamplingConfig(max_new_tokens=12), n) for n in ("", "qv", "mlp")]
    while engine.has_work():
        for event in engine.step():
            tokens.setdefault(event.request_id, []).extend(event.token_ids)
    models = [hf, merged(hf, dirs["qv"]), merged(hf, dirs["mlp"])]
    eos = hf.config.eos_token_id
    expected = [
        hf_generate(m, ids, max_new_tokens=12, eos_token_id=eos, pad_token_id=eos)[0, len(ids) :]
        for m in models
    ]
    expected = [e.tolist() for e in expected]
    assert [tokens[r] for r in order] == expected
    assert len({tuple(e) for e in expected}) == 3  # each adapter changes the tokens
