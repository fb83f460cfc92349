"""kdtree engine: model config and weights, the float64 golden reference, the device model, decoding."""
