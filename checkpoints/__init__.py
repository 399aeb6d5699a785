"""Checkpoint formats any stage may use: native DCP, HF, Megatron, DeepSpeed, FSDP readers/writers, the safe reader, LoRA adapters, streaming units, and writes beneath an opened root (safe_fs)."""
