"""llama.cpp's batch-1 greedy decode of a GGUF file, for bench/bench_quant_serve.py --served.

    python -m bench.llama_cpp_decode --threads N --tokens N --prompt ID,ID,.. FILE [FILE ...]

Reads one line per round on stdin and answers each with one JSON line: for every FILE, the
decode tokens/s of one greedy generation of `--tokens` new tokens after the fixed prompt
(prefill excluded: the clock starts after the prompt's `llama_decode`) and the first new
tokens. The model files are loaded once, before the first round, so that the rounds can be
interleaved with other engines' by the parent.

llama.cpp comes from the `llama-cpp-py-sync` package (prebuilt CPU wheels of llama.cpp's
shared libraries with CFFI bindings, no compiler needed); `available()` says why not where it
cannot be imported. The greedy loop is written here on the C API (`llama_decode` of one token,
the arg-max of `llama_get_logits_ith`), with no sampler or stop condition, as Meshline's
benchmark decodes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

GGUF_TYPES = {"F32": 0, "F16": 1, "Q4_1": 3, "Q8_0": 7}
"""llama.cpp's LLAMA_FTYPE_* numbers of the file types the benchmark writes."""


def available() -> str | None:
    """None when llama.cpp can be used here, else why not."""
    try:
        import llama_cpp_py_sync  # noqa: F401
    except Exception as exc:  # ImportError, or its shared library failing to load
        return f"llama-cpp-py-sync cannot be imported ({type(exc).__name__}: {exc})"
    return None


def quantize(source: Path, target: Path, kind: str, threads: int) -> None:
    """llama.cpp's `llama_model_quantize` of `source` into `target` as `kind` (GGUF_TYPES), the
    tensors requantized from whatever type `source` holds."""
    from llama_cpp_py_sync._cffi_bindings import get_ffi, get_lib

    lib, ffi = get_lib(), get_ffi()
    params = ffi.new("llama_model_quantize_params *", lib.llama_model_quantize_default_params())
    params.ftype = GGUF_TYPES[kind]
    params.nthread = threads
    params.allow_requantize = True
    result = lib.llama_model_quantize(str(source).encode(), str(target).encode(), params)
    if result != 0:
        raise RuntimeError(f"llama_model_quantize {source} -> {kind} failed ({result})")


class Decoder:
    """One GGUF model in llama.cpp, greedy batch-1 generation."""

    def __init__(self, path: Path, threads: int, context: int) -> None:
        from llama_cpp_py_sync import Llama

        self.llm: Any = Llama(str(path), n_ctx=context, n_batch=64, n_threads=threads)
        self.vocab = self.llm.n_vocab

    def generate(self, prompt: list[int], new: int) -> tuple[float, list[int]]:
        """(decode tokens/s, new tokens) of `new` greedy tokens after `prompt`."""
        import numpy as np

        llm, lib, ffi = self.llm, self.llm._lib, self.llm._ffi
        llm._clear_context_state()
        past = llm._eval_tokens(prompt, 0)
        ids: list[int] = []
        start = time.perf_counter()
        for _ in range(new):
            logits = lib.llama_get_logits_ith(llm._ctx, -1)
            row = np.frombuffer(ffi.buffer(logits, self.vocab * 4), dtype=np.float32)
            ids.append(int(row.argmax()))
            past = llm._eval_tokens([ids[-1]], past)
        return new / (time.perf_counter() - start), ids


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.llama_cpp_decode")
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--tokens", type=int, required=True)
    parser.add_argument("--prompt", required=True, help="token ids, comma-separated")
    parser.add_argument("files", type=Path, nargs="+")
    args = parser.parse_args(argv)
    prompt = [int(t) for t in args.prompt.split(",")]
    decoders = [Decoder(f, args.threads, len(prompt) + args.tokens + 8) for f in args.files]
    print(json.dumps({"ready": True}), flush=True)
    for _ in sys.stdin:
        rounds = {}
        for path, decoder in zip(args.files, decoders, strict=True):
            rate, ids = decoder.generate(prompt, args.tokens)
            rounds[path.name] = {"tokens_per_s": rate, "first_tokens": ids[:8]}
        print(json.dumps(rounds), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
