"""The float64 golden: the reference model, its layers, sampling and the DDTree reference algorithms."""
