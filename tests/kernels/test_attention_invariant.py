"""The batch-invariant MLA attention: the fp32 kernel (numba_kernels/attention/invariant.py) and the tensor-core one
(attention/invariant_tc.py).

- against the float64 reference (random trees, prefixes across split boundaries, NaN-poisoned outputs, cache
  rows past the in-flight ones NaN);
- the property they exist for: every node of a random tree, verified in one launch, has the bits of the 1-row
  AR step that decodes the same token after its root -> node path was committed (the path's rows moved to the
  end of the prefix), whether the row's keys fit one split or several;
- the compacted key table against numpy.
Simulator tests use toy sizes; the GPU tests use Kimi K2's c = 512, r = 64, h = 64.
"""
import numpy as np
import pytest
from numba import cuda

from kdspec.engine.bench.attention import random_tree_visibility
from kdspec.engine.golden.layers import mla_attention_latent
from kdspec.numba_kernels.attention.common import pack_visibility
from kdspec.numba_kernels.attention.decode import DEFAULT_CONFIG
from kdspec.numba_kernels.attention import invariant_tc
from kdspec.numba_kernels.attention.invariant import (
    KEYS_PER_SPLIT,
    LAUNCH_SHAPES,
    launch_shape,
    invariant_config,
    mla_attention_invariant,
    visible_keys,
)

from kernel_checks import assert_close, normal, poisoned

SCALE = 0.37


def inputs(rng, tokens, heads, latent, rope, prefix, spare_rows=3):
    """q_lat, q_pe, and a cache whose rows past the in-flight ones are NaN (never read)."""
    cache = normal(rng, prefix + tokens + spare_rows, latent + rope)
    cache[prefix + tokens:] = np.nan
    return normal(rng, tokens, heads, latent), normal(rng, tokens, heads, rope), cache


def fp32_attention(q_lat, q_pe, cache, prefix, visibility, out, shape=None):
    return mla_attention_invariant(q_lat, q_pe, cache, prefix, visibility, SCALE, out=out, shape=shape)


def tc_attention(q_lat, q_pe, cache, prefix, visibility, out, shape=None):
    return invariant_tc.mla_attention_invariant_tc(q_lat, q_pe, cache, prefix, visibility, SCALE, out=out,
                                                   config=shape)


def verify(q_lat, q_pe, cache, prefix, visible, shape=None, attention=fp32_attention):
    tokens, heads, latent = q_lat.shape
    return attention(q_lat, q_pe, cache, prefix, pack_visibility(visible), poisoned((tokens, heads, latent)),
                     shape=shape).copy_to_host()


def ar_step(q_lat, q_pe, cache, prefix, visible, node, attention=fp32_attention):
    """The output of node's token decoded alone: the prefix, then its path (ancestors and itself) as committed
    rows, the last of them in flight."""
    path = np.flatnonzero(visible[node])
    rows = np.concatenate([cache[:prefix], cache[prefix + path]])
    heads, latent = q_lat.shape[1], q_lat.shape[2]
    return attention(q_lat[node:node + 1], q_pe[node:node + 1], rows, len(rows) - 1,
                     pack_visibility(np.ones((1, 1), bool)), poisoned((1, heads, latent))).copy_to_host()[0]


def assert_rows_are_ar_steps(rng, tokens, heads, latent, rope, prefix, attention=fp32_attention):
    visible = random_tree_visibility(tokens, rng)
    q_lat, q_pe, cache = inputs(rng, tokens, heads, latent, rope, prefix)
    together = verify(q_lat, q_pe, cache, prefix, visible, attention=attention)
    assert np.isfinite(together).all()
    for node in range(tokens):
        alone = ar_step(q_lat, q_pe, cache, prefix, visible, node, attention)
        assert np.array_equal(alone.view(np.uint32), together[node].view(np.uint32)), (
            f"node {node} (depth {visible[node].sum() - 1}): max |diff| {np.abs(alone - together[node]).max():.3g}")


def assert_matches_reference(rng, tokens, heads, latent, rope, prefix, rtol, attention=fp32_attention):
    visible = random_tree_visibility(tokens, rng)
    q_lat, q_pe, cache = inputs(rng, tokens, heads, latent, rope, prefix)
    keys = cache[:prefix + tokens]
    full = np.concatenate([np.ones((tokens, prefix), bool), visible], axis=1)
    expected = mla_attention_latent(q_lat, q_pe, keys[:, :latent], keys[:, latent:], full, SCALE)
    assert_close(verify(q_lat, q_pe, cache, prefix, visible, attention=attention), expected, rtol)


@pytest.mark.sim
@pytest.mark.parametrize("tokens, heads, latent, rope, prefix", [
    (1, 2, 16, 4, 0),                       # the first token: one key
    (1, 3, 16, 4, KEYS_PER_SPLIT + 5),      # odd heads (one head per block), two splits
    (6, 2, 13, 2, 21),                      # c + r not a multiple of the lanes
    (40, 1, 8, 2, KEYS_PER_SPLIT - 20),     # more tokens than one mask word; rows cross the split boundary
])
def test_invariant_attention_matches_reference(tokens, heads, latent, rope, prefix):
    assert_matches_reference(np.random.default_rng(tokens * 100 + prefix + heads), tokens, heads, latent, rope,
                             prefix, 1e-5)


@pytest.mark.sim
@pytest.mark.parametrize("tokens, heads, prefix", [
    (12, 2, 5),                    # one split for everyone
    (12, 2, KEYS_PER_SPLIT - 6),   # deep rows spill into a second split, shallow ones do not
    (9, 3, 2 * KEYS_PER_SPLIT),    # three splits, one head per block
])
def test_tree_rows_equal_their_ar_steps_bit_for_bit(tokens, heads, prefix):
    assert_rows_are_ar_steps(np.random.default_rng(7 + tokens + prefix), tokens, heads, 16, 4, prefix)


@pytest.mark.sim
@pytest.mark.parametrize("tokens, prefix, spare", [(5, 3, 2), (4, 9, 2 * KEYS_PER_SPLIT + 3)])
def test_prefix_on_the_device_gives_the_same_bits(tokens, prefix, spare):
    """P read by the kernel from an int32 [1] device array, the grid sized for the whole cache (empty splits
    past every row's keys, spare > 2 splits): the bits of P given as a launch scalar."""
    rng = np.random.default_rng(tokens + spare)
    visible = random_tree_visibility(tokens, rng)
    q_lat, q_pe, cache = inputs(rng, tokens, 2, 16, 4, prefix, spare_rows=spare)
    scalar = verify(q_lat, q_pe, cache, prefix, visible)
    on_device = mla_attention_invariant(q_lat, q_pe, cache, cuda.to_device(np.array([prefix], np.int32)),
                                        pack_visibility(visible), SCALE,
                                        out=poisoned(q_lat.shape)).copy_to_host()
    assert not np.isnan(scalar).any()
    assert np.array_equal(scalar.view(np.uint32), on_device.view(np.uint32))
    with pytest.raises(ValueError, match="int32 \\[1\\]"):
        mla_attention_invariant(q_lat, q_pe, cache, cuda.to_device(np.array([prefix], np.int64)),
                                pack_visibility(visible), SCALE)


def assert_every_shape_gives_the_same_bits(rng, tokens, heads, latent, rope, prefix, shapes):
    visible = random_tree_visibility(tokens, rng)
    q_lat, q_pe, cache = inputs(rng, tokens, heads, latent, rope, prefix)
    default = verify(q_lat, q_pe, cache, prefix, visible, shape=DEFAULT_CONFIG)
    assert np.isfinite(default).all()
    for shape in shapes:
        result = verify(q_lat, q_pe, cache, prefix, visible, shape=shape)
        assert np.array_equal(result.view(np.uint32), default.view(np.uint32)), shape


@pytest.mark.sim
@pytest.mark.parametrize("tokens, prefix", [(1, 13), (5, KEYS_PER_SPLIT - 2)])
def test_launch_shapes_give_a_row_the_same_bits(tokens, prefix):
    """The shapes invariant_config may pick differ in heads a block, key groups, value loads in flight and
    threads: none of them changes a row's arithmetic, so the AR step's shape and a verify's agree."""
    shapes = [shape for _, shape in LAUNCH_SHAPES] + [DEFAULT_CONFIG._replace(heads=1, value_unroll=1),
              DEFAULT_CONFIG._replace(heads=4, key_group=2, threads=DEFAULT_CONFIG.lanes, value_unroll=3)]
    assert_every_shape_gives_the_same_bits(np.random.default_rng(tokens), tokens, 4, 16, 4, prefix, shapes)


@pytest.mark.sim
def test_a_shape_that_changes_a_rows_arithmetic_is_refused():
    for change in (dict(keys=2 * DEFAULT_CONFIG.keys), dict(fastmath=True)):
        with pytest.raises(ValueError, match="must keep DEFAULT_CONFIG"):
            invariant_config(4, shape=DEFAULT_CONFIG._replace(**change))


@pytest.mark.sim
def test_visible_key_table():
    rng = np.random.default_rng(3)
    tokens = 37
    visible = random_tree_visibility(tokens, rng)
    table = visible_keys(pack_visibility(visible), tokens)
    rows, counts = table.rows.copy_to_host(), table.counts.copy_to_host()
    for token in range(tokens):
        expected = np.flatnonzero(visible[token])
        assert counts[token] == len(expected)
        assert np.array_equal(rows[token, :counts[token]], expected)


@pytest.mark.sim
def test_block_heads_are_the_largest_power_of_two_dividing_the_heads():
    for tokens in (1, 4, 31, 32, 257):
        shape = launch_shape(tokens)
        for heads in (1, 2, 3, 5, 6, 12, 64, 128):
            config = invariant_config(heads, tokens)
            block = config.heads
            assert config.compact_keys and heads % block == 0 and block <= shape.heads
            assert 2 * block > shape.heads or heads % (2 * block), (heads, block)
            config.check()


@pytest.mark.sim
def test_rejects_a_mask_of_the_wrong_shape():
    with pytest.raises(ValueError, match="visibility"):
        visible_keys(cuda.to_device(np.zeros((3, 1), np.uint32)), 4)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens, prefix", [(64, 100), (64, KEYS_PER_SPLIT - 30), (256, 40)])
def test_k2_dims_rows_equal_their_ar_steps_and_the_reference(tokens, prefix):
    rng = np.random.default_rng(tokens + prefix)
    assert_rows_are_ar_steps(rng, tokens, 64, 512, 64, prefix)
    assert_matches_reference(rng, tokens, 64, 512, 64, prefix, 1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens, prefix", [(1, 100), (1, KEYS_PER_SPLIT + 70), (64, 100)])
def test_k2_dims_launch_shapes_give_a_row_the_same_bits(tokens, prefix):
    D = DEFAULT_CONFIG
    shapes = [shape for _, shape in LAUNCH_SHAPES] + [D._replace(heads=1, value_unroll=16),
              D._replace(heads=2, value_unroll=8, threads=128), D._replace(heads=16, key_group=2)]
    assert_every_shape_gives_the_same_bits(np.random.default_rng(tokens + prefix), tokens, 64, 512, 64, prefix,
                                           shapes)


# ---- the tensor-core kernel (attention/invariant_tc.py): tf32 operands, so the reference's tolerance is wider
TC_RTOL = 5e-3  # a numpy model of its roundings at K2 dims (random q, keys): 2.1e-3 of the largest output
TC_SPLIT = invariant_tc.KEYS_PER_SPLIT


@pytest.mark.sim
@pytest.mark.parametrize("tokens, heads, latent, rope, prefix", [
    (1, 2, 16, 4, 0),                       # the first token: one key; c + r not a multiple of 8
    (1, 3, 16, 4, TC_SPLIT + 5),            # two splits
    (5, 2, 24, 8, 20),                      # the small preset's dims; rows in one or two chunks
    (3, 17, 16, 4, 2 * TC_SPLIT + 6),       # two head tiles (the second of one head), three splits
    (34, 1, 8, 4, TC_SPLIT - 20),           # two mask words; rows cross the split boundary
])
def test_tensor_core_attention_matches_reference(tokens, heads, latent, rope, prefix):
    assert_matches_reference(np.random.default_rng(tokens * 100 + prefix + heads), tokens, heads, latent, rope,
                             prefix, TC_RTOL, tc_attention)


@pytest.mark.sim
@pytest.mark.parametrize("tokens, heads, prefix", [(12, 2, TC_SPLIT - 6), (9, 3, 2 * TC_SPLIT)])
def test_tensor_core_tree_rows_equal_their_ar_steps_bit_for_bit(tokens, heads, prefix):
    assert_rows_are_ar_steps(np.random.default_rng(7 + tokens + prefix), tokens, heads, 16, 4, prefix,
                             tc_attention)


@pytest.mark.sim
def test_tensor_core_prefix_on_the_device_stages_and_key_groups_give_the_same_bits():
    """P read from an int32 [1] device array (the grid sized for the whole cache: empty splits), two chunks in
    flight instead of one, and two warps a score share: the bits of the default launch."""
    tokens, prefix = 4, TC_SPLIT + 9
    rng = np.random.default_rng(11)
    visible = random_tree_visibility(tokens, rng)
    q_lat, q_pe, cache = inputs(rng, tokens, 2, 16, 4, prefix, spare_rows=2 * TC_SPLIT + 3)
    default = verify(q_lat, q_pe, cache, prefix, visible, attention=tc_attention)
    assert np.isfinite(default).all()
    on_device = verify(q_lat, q_pe, cache, cuda.to_device(np.array([prefix], np.int32)), visible,
                       attention=tc_attention)
    two_stages = verify(q_lat, q_pe, cache, prefix, visible, shape=invariant_tc.TcAttentionConfig(stages=2),
                        attention=tc_attention)
    key_groups = verify(q_lat, q_pe, cache, prefix, visible, shape=invariant_tc.TcAttentionConfig(key_groups=2),
                        attention=tc_attention)
    for other in (on_device, two_stages, key_groups):
        assert np.array_equal(other.view(np.uint32), default.view(np.uint32))


@pytest.mark.sim
def test_tensor_core_attention_refuses_rows_it_cannot_copy():
    rng = np.random.default_rng(2)
    q_lat, q_pe, cache = inputs(rng, 2, 2, 13, 2, 3)  # c + r = 15: not 16-byte pieces
    with pytest.raises(ValueError, match="multiple of 4"):
        verify(q_lat, q_pe, cache, 3, np.eye(2, dtype=bool), attention=tc_attention)
    assert not invariant_tc.supports(13, 2) and invariant_tc.supports(16, 4)
    q_lat, q_pe, cache = inputs(rng, 2, 2, 16, 4, 3)
    for config in (invariant_tc.TcAttentionConfig(stages=0), invariant_tc.TcAttentionConfig(stages=100),
                   invariant_tc.TcAttentionConfig(key_groups=3)):
        with pytest.raises(ValueError, match="bad TcAttentionConfig"):  # no chunk in flight; past 227 KB; 3 groups
            verify(q_lat, q_pe, cache, 3, np.eye(2, dtype=bool), shape=config, attention=tc_attention)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens, prefix", [(64, 100), (64, TC_SPLIT - 30), (256, 40)])
def test_k2_dims_tensor_core_rows_equal_their_ar_steps_and_the_reference(tokens, prefix):
    rng = np.random.default_rng(tokens + prefix)
    assert_rows_are_ar_steps(rng, tokens, 64, 512, 64, prefix, tc_attention)
    assert_matches_reference(rng, tokens, 64, 512, 64, prefix, TC_RTOL, tc_attention)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens, prefix", [(1, 100), (1, 2 * TC_SPLIT + 70), (64, 100)])
def test_k2_dims_tensor_core_stages_give_a_row_the_same_bits(tokens, prefix):
    rng = np.random.default_rng(tokens + prefix)
    visible = random_tree_visibility(tokens, rng)
    q_lat, q_pe, cache = inputs(rng, tokens, 64, 512, 64, prefix)
    default = verify(q_lat, q_pe, cache, prefix, visible, attention=tc_attention)
    assert np.isfinite(default).all()
    for config in (invariant_tc.TcAttentionConfig(stages=2, blocks_per_sm=1),
                   invariant_tc.TcAttentionConfig(stages=1, blocks_per_sm=1),
                   invariant_tc.TcAttentionConfig(stages=1, blocks_per_sm=1, key_groups=2),
                   invariant_tc.TcAttentionConfig(stages=2, blocks_per_sm=1, key_groups=4)):
        other = verify(q_lat, q_pe, cache, prefix, visible, shape=config, attention=tc_attention)
        assert np.array_equal(other.view(np.uint32), default.view(np.uint32)), config
