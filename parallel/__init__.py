"""Parallelism applied to models from outside: meshes, TP/SP/PP/CP/EP plans, data parallel and ZeRO, recompute, compile."""
