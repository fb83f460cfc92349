"""DecodeConfig: validated once, one-line errors; the AR shape and topk resolved in one place; bounds that
match the kernels'."""
import json
import re

import pytest

from kdspec.engine.decode.config import MAX_BLOCK_SIZE, MAX_BUDGET, DecodeConfig


def test_defaults_and_resolution():
    config = DecodeConfig(24, mode="ddtree", drafter="NOISY:0.70", budget=16)
    assert config.drafter == "noisy:0.7" and config.topk is None
    run = config.resolved(vocab_size=256)
    assert (run.block_size, run.budget, run.topk, run.num_depths) == (8, 16, 16, 7)
    assert config.resolved(vocab_size=10).topk == 10  # min(B, V)
    ar = DecodeConfig(5, block_size=4, budget=9, topk=3).resolved(256)
    assert (ar.mode, ar.block_size, ar.budget, ar.topk, ar.drafter) == ("ar", 1, 0, 0, None)
    assert ar.resolved(256) == ar  # resolving twice changes nothing


def test_as_dict_is_plain_json_with_every_field():
    import numpy as np
    config = DecodeConfig(np.int64(8), mode="ddtree", seed=np.int32(3), temperature=np.float32(0.5),
                          drafter="oracle").resolved(64)
    values = config.as_dict()
    assert json.loads(json.dumps(values)) == values
    assert set(values) == {"max_new_tokens", "mode", "block_size", "budget", "topk", "drafter", "temperature",
                           "seed", "record_logits"}
    assert DecodeConfig(**values) == config


@pytest.mark.parametrize("kwargs,message", [
    (dict(max_new_tokens=0), "max_new_tokens must be an integer >= 1"),
    (dict(mode="beam"), "mode must be one of ar, ddtree"),
    (dict(mode="ddtree", budget=0), "budget must be an integer >= 1"),
    (dict(budget=-1), "budget must be an integer >= 0"),  # AR: 0 is its own shape
    (dict(budget=MAX_BUDGET + 1), "budget must be at most 1024 (the device tree build"),
    (dict(block_size=MAX_BLOCK_SIZE + 1), "block_size must be at most 32 (the compaction kernel"),
    (dict(block_size=True), "block_size must be an integer"),
    (dict(mode="ddtree", topk=0), "topk must be an integer >= 1"),
    (dict(temperature=float("nan")), "temperature must be a finite number >= 0"),
    (dict(seed=1.5), "seed must be an integer >= 0"),
    (dict(drafter="oracle"), "drafter 'oracle' is only used in mode 'ddtree', got mode 'ar'"),
    (dict(mode="ddtree", drafter="magic"), "unknown drafter"),
    (dict(record_logits="yes"), "record_logits must be True or False"),
])
def test_bad_settings_are_one_line_errors(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)) as excinfo:
        DecodeConfig(**({"max_new_tokens": 4} | kwargs))
    assert "\n" not in str(excinfo.value)


def test_topk_above_the_vocabulary_is_refused_when_resolved():
    with pytest.raises(ValueError, match="topk must be at most the vocabulary size 64, got 65"):
        DecodeConfig(4, mode="ddtree", topk=65).resolved(64)


def test_frozen():
    with pytest.raises(AttributeError):
        DecodeConfig(4).budget = 3


def test_bounds_are_the_kernels():
    from kdspec.numba_kernels.tree import build, compact
    assert MAX_BUDGET == build.MAX_BUDGET and MAX_BLOCK_SIZE == compact.MAX_ACCEPT
