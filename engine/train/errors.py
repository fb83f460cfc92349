"""The one error type of the training package."""


class TrainError(ValueError):
    """Training input that cannot be used (corpus, vocabulary size, output directory); one-line message."""
