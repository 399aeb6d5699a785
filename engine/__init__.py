"""The inference engine any stage may use: KV-cache decoding, batching, sampling, beam search, scoring, loading a checkpoint for serving."""
