"""The block drafter's torch forward against a float64 numpy reference written from engine/model/drafter.py's text,
the anchor mask (a block never sees context rows >= P), the depth weights, and the tree-tau estimate."""
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kdspec.engine.golden.drafter import draft_logits, log_softmax  # noqa: E402
from kdspec.engine.model.drafter import DrafterConfig, DrafterError  # noqa: E402
from kdspec.engine.train.drafter_eval import tree_tau  # noqa: E402
from kdspec.engine.train.drafter_model import BlockDrafter, block_loss, depth_weights  # noqa: E402

D, V = 32, 50


def small_config(num_layers=2, block_size=5, layers=(1, 3, 4)) -> DrafterConfig:
    return DrafterConfig(hidden_size=D, target_layers=layers, num_layers=num_layers, num_heads=4, latent_dim=16,
                         rope_dim=8, intermediate_size=48, block_size=block_size)


def random_drafter(cfg: DrafterConfig, seed=0) -> BlockDrafter:
    model = BlockDrafter(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            base = 1.0 if name.endswith("norm.weight") else 0.0
            p.copy_(base + torch.randn(p.shape, generator=g) * (0.3 if base else 0.2))
    return model.eval()


def reference_draft(w: dict, cfg: DrafterConfig, h_ctx: np.ndarray, bonus: int, embed: np.ndarray,
                    lm_head: np.ndarray) -> np.ndarray:
    """float64 log-probs [L, V] of one block by the engine's golden (engine/golden/drafter.py): h_ctx [P, n*d]."""
    hidden = h_ctx.reshape(h_ctx.shape[0], len(cfg.target_layers), cfg.hidden_size).transpose(1, 0, 2)
    return log_softmax(draft_logits(cfg, w, embed, lm_head, hidden, bonus))


def torch_logprobs(model, ctx, anchors, bonus, embed, lm_head):
    hidden = model(ctx, anchors, bonus, embed)
    return torch.log_softmax(hidden @ lm_head.T, dim=-1)


@pytest.mark.parametrize("num_layers", [1, 2])
def test_torch_forward_matches_the_float64_reference(num_layers):
    cfg = small_config(num_layers)
    model = random_drafter(cfg, seed=num_layers)
    g = torch.Generator().manual_seed(7)
    S, T, A = 2, 11, 3
    ctx = torch.randn(S, T, 3 * D, generator=g)
    embed, lm_head = torch.randn(V, D, generator=g), torch.randn(V, D, generator=g) * 0.5
    anchors = torch.tensor([[1, 5, 11], [3, 7, 9]])
    bonus = torch.randint(V, (S, A), generator=g)
    with torch.no_grad():
        got = torch_logprobs(model, ctx, anchors, bonus, embed, lm_head).double().numpy()
    w = {name: p.detach().double().numpy() for name, p in model.named_parameters()}
    assert set(w) == set(cfg.parameter_shapes())
    assert all(w[name].shape == shape for name, shape in cfg.parameter_shapes().items())
    for s in range(S):
        for a in range(A):
            P = int(anchors[s, a])
            want = reference_draft(w, cfg, ctx[s, :P].double().numpy(), int(bonus[s, a]), embed.double().numpy(),
                                   lm_head.double().numpy())
            np.testing.assert_allclose(got[s, a], want, atol=1e-4, rtol=0)


def test_a_block_never_sees_context_rows_at_or_after_its_anchor():
    cfg = small_config()
    model = random_drafter(cfg)
    g = torch.Generator().manual_seed(3)
    T = 12
    ctx = torch.randn(1, T, 3 * D, generator=g)
    embed, lm_head = torch.randn(V, D, generator=g), torch.randn(V, D, generator=g)
    anchors, bonus = torch.tensor([[2, 6, 12]]), torch.tensor([[4, 9, 1]])
    with torch.no_grad():
        before = torch_logprobs(model, ctx, anchors, bonus, embed, lm_head)
        perturbed = ctx.clone()
        perturbed[:, 6:] += 10 * torch.randn(1, T - 6, 3 * D, generator=g)
        after = torch_logprobs(model, perturbed, anchors, bonus, embed, lm_head)
        earlier = ctx.clone()
        earlier[:, 5] += 10.0
        moved = torch_logprobs(model, earlier, anchors, bonus, embed, lm_head)
    assert torch.equal(before[0, :2], after[0, :2])       # anchors 2 and 6 see rows < 6 only
    assert not torch.allclose(before[0, 2], after[0, 2])  # anchor 12 sees them
    assert torch.equal(before[0, 0], moved[0, 0]) and not torch.allclose(before[0, 1], moved[0, 1])


def test_blocks_do_not_see_each_other():
    cfg = small_config()
    model = random_drafter(cfg)
    g = torch.Generator().manual_seed(4)
    ctx = torch.randn(1, 9, 3 * D, generator=g)
    embed, lm_head = torch.randn(V, D, generator=g), torch.randn(V, D, generator=g)
    with torch.no_grad():
        both = torch_logprobs(model, ctx, torch.tensor([[4, 8]]), torch.tensor([[3, 5]]), embed, lm_head)
        alone = torch_logprobs(model, ctx, torch.tensor([[4]]), torch.tensor([[3]]), embed, lm_head)
        other = torch_logprobs(model, ctx, torch.tensor([[4, 8]]), torch.tensor([[3, 6]]), embed, lm_head)
    # equal up to fp32 rounding (a GEMM over two blocks may sum in another order than over one: 1.7e-5 on log-probs
    # near -12 with torch 2.14 on a CPU); a block that saw the other's bonus would move by far more, as the second
    # block itself does
    torch.testing.assert_close(both[0, 0], alone[0, 0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(both[0, 0], other[0, 0], atol=1e-6, rtol=1e-5)
    assert (both[0, 1] - other[0, 1]).abs().max() > 1e-2


def test_depth_weights_and_the_weighted_loss():
    w = depth_weights(7, 4.0)
    raw = [math.exp(-(j - 1) / 4.0) for j in range(1, 8)]
    np.testing.assert_allclose(w.numpy(), [x / sum(raw) for x in raw], rtol=1e-6)
    g = torch.Generator().manual_seed(0)
    hidden, lm_head = torch.randn(3, 2, 7, D, generator=g), torch.randn(V, D, generator=g)
    labels = torch.randint(V, (3, 2, 7), generator=g)
    loss, per_depth = block_loss(hidden, labels, lm_head, w)
    ce = torch.nn.functional.cross_entropy((hidden @ lm_head.T).reshape(-1, V), labels.reshape(-1),
                                           reduction="none").view(3, 2, 7)
    by_hand = sum(raw[j] * ce[..., j] for j in range(7)).mean() / sum(raw)
    torch.testing.assert_close(loss, by_hand, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(per_depth, ce.reshape(-1, 7).mean(0))


def test_config_round_trip_and_bad_shapes(tmp_path):
    cfg = small_config()
    cfg.save(tmp_path)
    assert DrafterConfig.load(tmp_path) == cfg
    assert cfg.to_dict()["architecture"] == "kdtree-dflash" and cfg.num_depths == 4
    with pytest.raises(DrafterError, match="block size"):
        small_config(block_size=1)
    with pytest.raises(DrafterError, match="increasing"):
        small_config(layers=(3, 2))


def test_tree_tau_by_hand():
    # two depths, K = 2: lp depth 1 = (-0.1, -2.5), depth 2 = (-0.2, -0.3)
    lp = np.log(np.array([[[0.9, 0.08], [0.8, 0.15]]]))
    # target path ranks (0, 1): nodes pop as (0,) [0.9], (0,0) [0.72], (0,1) [0.135], (1,) [0.08]
    got = tree_tau(lp, np.array([[0, 1]]), (1, 2, 3, 4))
    assert got == {1: 2.0, 2: 2.0, 3: 3.0, 4: 3.0}
    assert tree_tau(lp, np.array([[1, 0]]), (3, 4, 5)) == {3: 1.0, 4: 2.0, 5: 3.0}
