"""The training library: the loop, objectives, optimizer and schedules, precision and loss scaling,
train-state checkpoints, batching, fine-tuning setup and the typed config they read.

Kept free of imports so that importing one module stays cheap.
"""
