"""Models on disk and in memory: config, weights, safetensors I/O, checkpoints, tokenizers."""
