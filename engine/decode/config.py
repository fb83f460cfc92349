"""DecodeConfig: every setting of one decode run, validated once, with one-line ValueError messages.

    config = DecodeConfig(24, mode="ddtree", drafter="noisy:0.7", budget=16)
    run = config.resolved(vocab_size)   # the settings the run uses (topk filled in; AR as a one-node tree)
    run.as_dict()                       # the trace's decode_config metadata

The command line, the API (Engine.generate), the loop (generate) and the trace writer (as ``as_dict()``) all
take it. What depends on the model (topk against V, prompt + max_new_tokens against the positions) is checked
by ``resolved`` and ``loop.check_prompt``; the weight dtype is a property of the loaded model (api.load), not a
decode setting.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Optional

import numpy as np

from kdspec.engine.decode.drafters import parse_drafter
from kdspec.traces.schema import MODES

# L + 1 <= 32: the compaction kernel moves at most 32 accepted rows a step (numba_kernels/tree/compact.py
# MAX_ACCEPT), and one 32-bit word holds a path's visibility in the decode attention kernel.
MAX_BLOCK_SIZE = 32
# B <= 1024: the device tree build keeps the tree in one block's shared memory (numba_kernels/tree/build.py
# MAX_BUDGET).
MAX_BUDGET = 1024
# The noise hash keys on the seed as a uint64 (engine/golden/sampling.py).
MAX_SEED = 2 ** 64 - 1


def _check_int(name: str, value, low: int, high: Optional[int] = None, why: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be at most {high} ({why}), got {value}")
    return int(value)


@dataclass(frozen=True)
class DecodeConfig:
    """The settings of one decode run.

    max_new_tokens: tokens to produce (the prefill's token counts).
    mode: "ar" (one forward per token) or "ddtree" (drafter + tree verify).
    # the tree (mode "ddtree"; an AR run ignores these: ``resolved`` makes it a one-node tree)
    block_size: L + 1, the bonus token plus L drafted depths (1..MAX_BLOCK_SIZE).
    budget: B, non-root tree nodes at most (1..MAX_BUDGET).
    topk: K, the drafter's candidates per depth; None -> min(B, V) (``resolved``).
    drafter: "oracle" | "noisy:P" (built over the golden run by Engine.generate), or None.
    # sampling
    temperature: T = 0 greedy; T > 0 Gumbel-max keyed by (seed, absolute position).
    seed: the sampling noise and the noisy drafter's.
    # records
    record_logits: records also carry ``logits`` float32 [tau, V] (traces of small vocabularies).
    """

    max_new_tokens: int
    mode: str = "ar"
    block_size: int = 8
    budget: int = 7
    topk: Optional[int] = None
    drafter: Optional[str] = None
    temperature: float = 0.0
    seed: int = 0
    record_logits: bool = False

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        tree_low = 1 if self.mode == "ddtree" else 0  # 0: the AR shape of ``resolved``
        checked = dict(
            max_new_tokens=_check_int("max_new_tokens", self.max_new_tokens, 1),
            # a DDTree step drafts at least one depth (block_size 1 is AR: mode "ar")
            block_size=_check_int("block_size", self.block_size, 1 + tree_low, MAX_BLOCK_SIZE,
                                  "the compaction kernel moves at most 32 accepted rows a step"),
            budget=_check_int("budget", self.budget, tree_low, MAX_BUDGET,
                              "the device tree build holds at most 1024 nodes in one block's shared memory"),
            topk=None if self.topk is None else _check_int("topk", self.topk, tree_low),
            seed=_check_int("seed", self.seed, 0, MAX_SEED, "the sampling noise keys on a 64-bit seed"))
        temperature = self.temperature
        if (isinstance(temperature, bool) or not isinstance(temperature, (int, float, np.floating))
                or not math.isfinite(temperature) or temperature < 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
        if self.drafter is not None:
            if self.mode != "ddtree":
                raise ValueError(f"drafter {self.drafter!r} is only used in mode 'ddtree', got mode {self.mode!r}")
            checked["drafter"] = str(parse_drafter(self.drafter))  # canonical: "oracle" | "noisy:P"
        if not isinstance(self.record_logits, (bool, np.bool_)):
            raise ValueError(f"record_logits must be True or False, got {self.record_logits!r}")
        # numpy scalars become Python ones, so as_dict() is plain JSON
        checked.update(temperature=float(temperature), record_logits=bool(self.record_logits))
        for name, value in checked.items():
            object.__setattr__(self, name, value)

    def resolved(self, vocab_size: int) -> "DecodeConfig":
        """The settings the run uses, for a model of ``vocab_size`` tokens: topk None -> min(budget, V); an AR
        run as the one-node tree per token it records (block_size 1, budget 0, topk 0). Raises ValueError when
        topk exceeds V."""
        if self.mode == "ar":
            return replace(self, block_size=1, budget=0, topk=0)
        topk = min(self.budget, vocab_size) if self.topk is None else self.topk
        if topk > vocab_size:
            raise ValueError(f"topk must be at most the vocabulary size {vocab_size}, got {topk}")
        return replace(self, topk=topk)

    @property
    def num_depths(self) -> int:
        """L, the drafted depths (0 for AR once resolved)."""
        return self.block_size - 1

    def as_dict(self) -> dict:
        """Plain JSON-able values (the trace's decode_config): every field by name."""
        return asdict(self)
