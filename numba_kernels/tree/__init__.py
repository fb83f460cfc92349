"""DDTree kernels: tree build, accept walk, and KV cache compaction."""
