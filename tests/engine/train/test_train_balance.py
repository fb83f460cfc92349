"""balance.py: routed counts from the router hooks and DeepSeek-V3's sign bias update."""
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from kdspec.engine.train.balance import RouterLoads, load_spread  # noqa: E402


class FixedRouter(torch.nn.Module):
    """Returns the router triple with preset expert choices."""

    def __init__(self, choices):
        super().__init__()
        self.e_score_correction_bias = torch.nn.Buffer(torch.zeros(4))
        self.choices = choices

    def forward(self, hidden):
        return None, None, self.choices


def fake_model(routers):
    layers = [SimpleNamespace(mlp=SimpleNamespace())] + [SimpleNamespace(mlp=SimpleNamespace(gate=r)) for r in routers]
    return SimpleNamespace(model=SimpleNamespace(layers=layers))


def test_counts_and_sign_update():
    router = FixedRouter(torch.tensor([[0, 1], [0, 2], [0, 1]]))
    loads = RouterLoads(fake_model([router]))
    router(torch.zeros(3, 8))
    counts = loads.take()
    assert counts.tolist() == [[3, 2, 1, 0]]  # mean 1.5
    loads.update_biases(counts, rate=0.01)
    assert router.e_score_correction_bias.tolist() == pytest.approx([-0.01, -0.01, 0.01, 0.01])
    assert loads.take().tolist() == [[0, 0, 0, 0]]  # take clears


def test_valid_mask_drops_padding_rows():
    router = FixedRouter(torch.tensor([[0, 1], [2, 3]]))
    loads = RouterLoads(fake_model([router]))
    router(torch.zeros(2, 8))
    assert loads.take(valid=torch.tensor([True, False])).tolist() == [[1, 1, 0, 0]]


def test_load_spread():
    spread = load_spread(torch.tensor([[4, 2, 2, 4], [1, 1, 1, 0]]))
    assert spread["per_layer"][0]["max_over_min"] == 2.0
    assert spread["per_layer"][0]["cv"] == pytest.approx(1 / 3)
    assert spread["max_over_min_worst"] is None  # an expert of layer 2 got nothing
