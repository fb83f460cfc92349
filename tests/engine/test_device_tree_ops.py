"""DeviceTreeOps over a run of steps: trees built into one budget's reused device buffers and accepted from their
device copy equal the reference build and walk, step after step, budgets changing, whichever tree is accepted."""
import numpy as np
import pytest

from kdspec.engine.golden import ddtree as ddtree_ref

pytestmark = pytest.mark.sim


def _draft(rng, depths: int, topk: int, vocab: int = 500):
    logprobs = np.sort(rng.standard_normal((depths, topk)).astype(np.float32), axis=1)[:, ::-1] - 1.0
    ids = np.stack([rng.choice(vocab, topk, replace=False) for _ in range(depths)]).astype(np.int64)
    return np.ascontiguousarray(logprobs), ids


def _choice_along_a_path(rng, tree, vocab: int = 500):
    """The target's choice per node: each node picks one of its children's tokens (or a token no child has)
    with even odds, so walks stop at every depth."""
    choice = rng.integers(vocab, 2 * vocab, tree.num_nodes)   # tokens no drafted child has
    for node in range(tree.num_nodes):
        children = np.flatnonzero(tree.parents == node)
        if len(children) and rng.random() < 0.7:
            choice[node] = tree.tokens[rng.choice(children)]
    return choice


def _visibility(tree) -> np.ndarray:
    packed = tree.visibility.copy_to_host()
    bits = np.unpackbits(packed.view(np.uint8), axis=1, bitorder="little").astype(bool)
    return bits[:, :tree.num_nodes]


def _same_tree(ours, want):
    for name in ("tokens", "parents", "depths", "ranks", "scores", "positions"):
        np.testing.assert_array_equal(getattr(ours, name), getattr(want, name), err_msg=name)
    np.testing.assert_array_equal(_visibility(ours), want.visibility)


def test_steps_with_reused_buffers_equal_the_reference():
    from kdspec.engine.device.tree_ops import DeviceTreeOps
    rng = np.random.default_rng(11)
    ops = DeviceTreeOps()
    walks = []
    for step, budget in enumerate([5, 12, 5, 3, 12, 12]):
        logprobs, ids = _draft(rng, depths=int(rng.integers(1, 6)), topk=4)
        root, prefix = int(rng.integers(0, 500)), 10 + step
        tree = ops.build_tree(logprobs, ids, root, budget, prefix)
        want = ddtree_ref.build_tree(logprobs, ids, root, budget, prefix)
        _same_tree(tree, want)
        choice = _choice_along_a_path(rng, want)
        accepted, bonus = ops.accept(tree.parents, tree.tokens, choice)         # from the device copy
        want_accepted, want_bonus = ddtree_ref.accept(want.parents, want.tokens, choice)
        np.testing.assert_array_equal(accepted, want_accepted)
        assert accepted.dtype == np.int32 and bonus == want_bonus
        walks.append(len(accepted))
        copies = ops.accept(tree.parents.copy(), tree.tokens.copy(), choice)      # host arrays: uploaded
        np.testing.assert_array_equal(copies[0], want_accepted)
        assert copies[1] == want_bonus
    assert len(set(walks)) > 1   # the walks stopped at different depths


def test_a_tree_accepted_after_another_was_built_is_walked_from_its_host_arrays():
    """The device buffers hold the last tree built at a budget; accepting an earlier tree must not read them."""
    from kdspec.engine.device.tree_ops import DeviceTreeOps
    rng = np.random.default_rng(12)
    ops = DeviceTreeOps()
    first_draft, second_draft = _draft(rng, 4, 3), _draft(rng, 4, 3)
    first = ops.build_tree(*first_draft, 7, 6, 0)
    second = ops.build_tree(*second_draft, 9, 6, 0)              # same budget: overwrites first's device copy
    for tree, (logprobs, ids), root in ((first, first_draft, 7), (second, second_draft, 9)):
        want = ddtree_ref.build_tree(logprobs, ids, root, 6, 0)
        choice = _choice_along_a_path(rng, want)
        np.testing.assert_array_equal(ops.accept(tree.parents, tree.tokens, choice)[0],
                                      ddtree_ref.accept(want.parents, want.tokens, choice)[0])


def test_accept_into_buffers_of_the_wrong_shape_is_refused():
    from numba import cuda

    from kdspec.numba_kernels.tree import accept as tree_accept
    parents, tokens, choice = (np.array([[-1, 0]], np.int32), np.array([[3, 4]], np.int32),
                               np.array([[4, 5]], np.int32))
    good = (cuda.device_array((1, 3), np.int32), cuda.device_array(1, np.int32), cuda.device_array(1, np.int32))
    accepted, tau, bonus = tree_accept.accept_trees(parents, tokens, choice, np.array([2], np.int32), 2, out=good)
    assert accepted is good[0] and list(accepted.copy_to_host()[0]) == [0, 1, -1] and bonus.copy_to_host()[0] == 5
    bad = (cuda.device_array((1, 2), np.int32),) + good[1:]
    with pytest.raises(ValueError, match="out holds"):
        tree_accept.accept_trees(parents, tokens, choice, np.array([2], np.int32), 2, out=bad)


def test_builds_of_one_request_after_a_batch_launch_one_block():
    """A batch of 3 trees, then one tree: the one-tree launch must not keep the batch's grid (the simulator's
    kernel[...] configures the kernel object itself)."""
    from kdspec.numba_kernels.tree import build as tree_build
    rng = np.random.default_rng(13)
    drafts = [_draft(rng, 5, 4) for _ in range(3)]
    logprobs = np.stack([d[0] for d in drafts])
    ids = np.stack([d[1] for d in drafts]).astype(np.int32)
    tree_build.build_trees(logprobs, ids, np.arange(3, dtype=np.int32), np.zeros(3, np.int32), 6)
    one = tree_build.build_trees(logprobs[:1], ids[:1], np.zeros(1, np.int32), np.zeros(1, np.int32), 6).to_host()
    want = ddtree_ref.build_tree(drafts[0][0], drafts[0][1], 0, 6, 0)
    np.testing.assert_array_equal(one["tokens"][0, :want.num_nodes], want.tokens)
