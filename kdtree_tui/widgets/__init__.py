"""One widget per file: step list, tree / logits / cache / run / compare panels."""
