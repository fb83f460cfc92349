"""The device model: the forward on the Numba kernels, its backend ops, cache, logits, tree ops and CUDA graphs."""
