"""Every CUDA kernel of kdtree with its launcher; nothing else lives here."""
