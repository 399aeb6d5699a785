"""Token data any stage may use: Megatron .bin/.idx, Arrow shards, GPT / blended / instruction datasets, samplers."""
