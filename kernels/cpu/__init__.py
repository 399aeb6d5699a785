"""CPU backends: fused fp32 training kernels in C (train_ops.c), wrapped by fused.py."""
