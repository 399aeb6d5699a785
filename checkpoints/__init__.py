"""Checkpoint formats any stage may use: native DCP, HF, Megatron, DeepSpeed, FSDP readers/writers, the safe reader, LoRA adapters, streaming units."""
