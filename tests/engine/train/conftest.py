"""Fixtures of the training tests."""
import pytest
from train_helpers import make_tiny_stdlib


@pytest.fixture
def tiny_stdlib(tmp_path):
    return make_tiny_stdlib(tmp_path / "stdlib")
