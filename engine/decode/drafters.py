"""Drafters: for depths 1..L after the bonus token, the top-K candidate tokens and their log-probs.

The interface (docs/ddtree.md, step 1): ``draft(committed_tokens, bonus_token, position)`` with the bonus
token b as the root at absolute position P = ``position``; row d-1 of the result predicts position P+d.
Returns (ids int32 [L, K], logprobs float32 [L, K]), each row sorted descending by log-prob, ids distinct
within a row.

BlockDrafter is the trained one (DFlash-style, engine/model/drafter.py): it reads the target's hidden states of
the committed rows, which the cache keeps for the layers the drafter names (``hidden_layers``); the loop passes
the cache to ``draft`` as ``cache=`` for such a drafter.

Oracle drafters know the golden sequence by absolute position (prompt followed by the golden continuation)
and are how the DDTree loop is tested without a trained drafter: the oracle puts the golden token at rank 0
(every step accepts the whole chain), the noisy oracle keeps it there only with probability p per position.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Protocol, Sequence

import numpy as np

from kdspec.engine.golden.drafter import draft_logits, log_softmax
from kdspec.engine.model.drafter import DrafterConfig

# Log-probs past the end of the golden sequence: far below every real candidate, so such nodes pop last.
SENTINEL_LOGPROB = -40.0
# Oracle distribution at one depth: the golden token gets ORACLE_TOP_PROB, the distractors share the rest
# geometrically (each half the previous), so a full chain of L <= 100 rank-0 nodes outscores any sibling.
ORACLE_TOP_PROB = 0.999
# Positions an oracle computes its rows for at once (int32 [ORACLE_BLOCK, K] kept): a step then copies its rows.
ORACLE_BLOCK = 256
# Keeps the noisy oracle's decisions independent of the sampling noise drawn with the same seed.
NOISE_SALT = 0x6E6F697379  # "noisy"


class Drafter(Protocol):
    """What the decode loop needs from a drafter."""

    num_depths: int  # L = block_size - 1
    top_k: int       # K

    def draft(self, committed_tokens: np.ndarray, bonus_token: int, position: int) -> tuple[np.ndarray, np.ndarray]:
        """committed_tokens int [P] (prompt + tokens in the cache), bonus token at ``position`` = P ->
        (ids int32 [L, K], logprobs float32 [L, K] sorted descending); row d-1 predicts position P+d."""
        ...


def _oracle_logprobs(top_k: int) -> np.ndarray:
    """float32 [K]: log ORACLE_TOP_PROB, then the remaining mass halved rank after rank (strictly decreasing)."""
    rest = 0.5 ** np.arange(top_k - 1, dtype=np.float64)
    rest = (1.0 - ORACLE_TOP_PROB) * rest / max(rest.sum(), 1.0)
    return np.log(np.concatenate([[ORACLE_TOP_PROB], rest])).astype(np.float32)


def _unsure_logprobs(top_k: int) -> np.ndarray:
    """float32 [K]: probabilities halving rank after rank (1/2, 1/4, ...), normalised: a drafter unsure of
    the position, so the tree spends budget on siblings there."""
    probs = 0.5 ** np.arange(1, top_k + 1, dtype=np.float64)
    return np.log(probs / probs.sum()).astype(np.float32)


class OracleDrafter:
    """Golden token at rank 0 at every depth; distinct distractors (golden+1, golden+2, ... mod V) below it.

    Args:
        golden_tokens: int [T], the golden token at every absolute position 0..T-1 (prompt then continuation).
        num_depths: L. top_k: K (<= vocab). vocab: V.
    Past the end of the golden sequence a depth holds tokens 0..K-1 at SENTINEL_LOGPROB - rank.
    """

    def __init__(self, golden_tokens: Sequence[int], num_depths: int, top_k: int, vocab: int):
        golden = np.asarray(golden_tokens, dtype=np.int64)
        if golden.ndim != 1:
            raise ValueError(f"golden_tokens must be a 1-D sequence of token ids, got shape {golden.shape}")
        if num_depths < 0:
            raise ValueError(f"num_depths must be >= 0, got {num_depths}")
        if not 1 <= top_k <= vocab:
            raise ValueError(f"top_k must be in 1..vocab ({vocab}), got {top_k}")
        if golden.size and (golden.min() < 0 or golden.max() >= vocab):
            raise ValueError(f"golden_tokens must be in 0..{vocab - 1}, got {golden.min()}..{golden.max()}")
        self.golden = golden
        self.num_depths, self.top_k, self.vocab = int(num_depths), int(top_k), int(vocab)
        self._logprobs = _oracle_logprobs(self.top_k)
        self._ranks = np.arange(self.top_k, dtype=np.int64)
        self._sentinel = (SENTINEL_LOGPROB - self._ranks).astype(np.float32)
        self._blocks: dict[int, np.ndarray] = {}  # position // ORACLE_BLOCK -> ids int32 [ORACLE_BLOCK, K]

    def _rows_at(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(ids int32 [n, K], logprobs float32 [n, K]) predicting each absolute position of ``positions`` (int
        [n], >= 0), in one pass: the drafter's host time is part of every step's."""
        known = positions < len(self.golden)
        golden = self.golden[np.where(known, positions, 0)] if len(self.golden) else np.zeros(len(positions), np.int64)
        ids = np.where(known[:, None], (golden[:, None] + self._ranks) % self.vocab, self._ranks).astype(np.int32)
        logprobs = np.where(known[:, None], self._logprobs, self._sentinel)
        return ids, logprobs

    def _row(self, position: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids int32 [K], logprobs float32 [K]) predicting absolute ``position``."""
        ids, logprobs = self._rows_at(np.array([position]))
        return ids[0], logprobs[0]

    def draft(self, committed_tokens, bonus_token: int, position: int) -> tuple[np.ndarray, np.ndarray]:
        if position < 0:
            raise ValueError(f"position must be >= 0, got {position}")
        first, stop = position + 1, position + 1 + self.num_depths
        block = first // ORACLE_BLOCK
        if self.num_depths and stop <= len(self.golden) and (stop - 1) // ORACLE_BLOCK == block:
            # rows inside the golden sequence and one block of them: copies of rows computed once
            if block not in self._blocks:
                self._blocks[block] = self._rows_at(block * ORACLE_BLOCK + np.arange(ORACLE_BLOCK))[0]
            rows = self._blocks[block][first - block * ORACLE_BLOCK:stop - block * ORACLE_BLOCK]
            return rows.copy(), np.broadcast_to(self._logprobs, rows.shape).copy()
        return self._rows_at(position + 1 + np.arange(self.num_depths))


class NoisyOracleDrafter(OracleDrafter):
    """The oracle with misses: at each absolute position, with probability ``p`` the golden token is at rank 0;
    otherwise a distractor takes rank 0 and the golden token is moved to a lower rank or dropped (even odds); a
    moved token lands at rank r with probability 2^-r (capped at K-1), as a real drafter's second guesses
    concentrate near the top, so a wider tree recovers more of them,
    and the row's log-probs are flatter (``_unsure_logprobs``): like a real drafter, it is less sure where it is
    wrong, so DDTree's siblings can recover a moved golden token.

    The decision depends only on (seed, absolute position), so every step that drafts a position sees the same
    row and a run is reproducible.
    """

    def __init__(self, golden_tokens: Sequence[int], p: float, seed: int, num_depths: int, top_k: int, vocab: int):
        super().__init__(golden_tokens, num_depths, top_k, vocab)
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"noisy oracle hit rate p must be in [0, 1], got {p}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self.p, self.seed = float(p), int(seed)
        self._rows: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # position -> (ids, logprobs): _kept_row

    def draft(self, committed_tokens, bonus_token: int, position: int) -> tuple[np.ndarray, np.ndarray]:
        if position < 0:
            raise ValueError(f"position must be >= 0, got {position}")
        ids = np.empty((self.num_depths, self.top_k), dtype=np.int32)
        logprobs = np.empty((self.num_depths, self.top_k), dtype=np.float32)
        for depth in range(1, self.num_depths + 1):
            ids[depth - 1], logprobs[depth - 1] = self._kept_row(position + depth)
        return ids, logprobs

    def _kept_row(self, position: int) -> tuple[np.ndarray, np.ndarray]:
        """_row(position), computed once: a row depends on the position alone, and consecutive steps draft
        overlapping positions (its random draws cost more than the oracle's rows)."""
        row = self._rows.get(position)
        if row is None:
            row = self._rows[position] = self._row(position)
        return row

    def golden_rank(self, position: int) -> int:
        """Rank of the golden token at absolute ``position`` (0 = hit), -1 when dropped."""
        rng = np.random.default_rng([self.seed, NOISE_SALT, position])
        hit, drop, rank = rng.random(), rng.random(), min(rng.geometric(0.5), max(self.top_k - 1, 1))
        if hit < self.p or self.vocab == 1:
            return 0
        # Dropping needs a spare token to fill the row (K < V); moving needs a rank below 0 (K > 1).
        if self.top_k == 1 or (drop < 0.5 and self.top_k < self.vocab):
            return -1
        return int(rank)

    def _row(self, position: int) -> tuple[np.ndarray, np.ndarray]:
        ids, logprobs = super()._row(position)
        if position >= len(self.golden):
            return ids, logprobs
        rank = self.golden_rank(position)
        if rank == 0:
            return ids, logprobs
        golden = int(self.golden[position])
        # K+1 candidates: distractors golden+1 .. golden+K (mod V; distinct from golden only when K < V).
        distractors = [int(t) for t in (golden + 1 + np.arange(self.top_k)) % self.vocab if t != golden]
        row = distractors[:self.top_k] if rank < 0 else distractors[:rank] + [golden] + distractors[rank:]
        return np.asarray(row[:self.top_k], dtype=np.int32), _unsure_logprobs(self.top_k)


def top_k_rows(logprobs: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row the k largest log-probs, descending (ties -> the lower id): (ids int32 [L, k], float32 [L, k])."""
    order = np.lexsort((np.broadcast_to(np.arange(logprobs.shape[1]), logprobs.shape), -logprobs), axis=-1)[:, :k]
    return order.astype(np.int32), np.take_along_axis(logprobs, order, axis=-1).astype(np.float32)


class BlockDrafter:
    """The trained block drafter. Without ``device``: by its float64 golden (engine/golden/drafter.py), on any
    backend, the target's kept hidden states of rows 0..P-1 copied from ``model.hidden_rows(cache, P)``. With
    ``device`` (engine/device/drafter.py DeviceDrafter, the sim and cuda backends): its fp32 forward on the
    device model's kernels, the hidden states read where the cache keeps them; only the draft comes back.

    Args:
        cfg, weights: the drafter (engine/model/drafter.py load_drafter). embed, lm_head: the target's [V, d].
        top_k: K candidates per depth. model: the target (for hidden_rows). name, digest: for the trace.
        device: the DeviceDrafter that drafts instead of the golden (same cfg and top_k), or None.
    """

    def __init__(self, cfg: DrafterConfig, weights: dict, embed: np.ndarray, lm_head: np.ndarray, top_k: int,
                 model, name: str = "dflash", digest: str = "", device=None):
        if not 1 <= top_k <= embed.shape[0]:
            raise ValueError(f"top_k must be in 1..vocab ({embed.shape[0]}), got {top_k}")
        if device is not None and (device.cfg != cfg or device.top_k != top_k):
            raise ValueError("the device drafter must have this drafter's config and top_k")
        self.cfg, self.weights, self.embed, self.lm_head, self.model = cfg, weights, embed, lm_head, model
        self.num_depths, self.top_k, self.name, self.digest = cfg.num_depths, int(top_k), name, digest
        self.hidden_layers = cfg.target_layers
        self.device = device

    def draft(self, committed_tokens, bonus_token: int, position: int, cache=None) -> tuple[np.ndarray, np.ndarray]:
        if cache is None:
            raise ValueError("a block drafter reads the target's hidden states: draft(..., cache=the run's cache)")
        if self.device is not None:
            return self.device.draft(committed_tokens, bonus_token, position, cache)
        hidden = self.model.hidden_rows(cache, position)
        logits = draft_logits(self.cfg, self.weights, self.embed, self.lm_head, hidden, int(bonus_token))
        return top_k_rows(log_softmax(logits), self.top_k)


@dataclass(frozen=True)
class DrafterSpec:
    """A parsed drafter name: ``kind`` "oracle" | "noisy" | "dflash"; ``p`` the noisy hit rate; ``path`` a
    dflash drafter's directory (None: ``drafter/`` beside the model)."""

    kind: str
    p: float = 1.0
    path: Optional[str] = None

    @property
    def needs_golden(self) -> bool:
        """Whether the drafter reads the golden continuation (the oracles do; a trained drafter does not)."""
        return self.kind != "dflash"

    def build(self, golden_tokens: Sequence[int], num_depths: int, top_k: int, vocab: int, seed: int = 0):
        """The drafter over the golden sequence by absolute position (prompt + golden continuation)."""
        if self.kind == "oracle":
            return OracleDrafter(golden_tokens, num_depths, top_k, vocab)
        return NoisyOracleDrafter(golden_tokens, self.p, seed, num_depths, top_k, vocab)

    def __str__(self) -> str:
        if self.kind == "dflash":
            return "dflash" if self.path is None else f"dflash:{self.path}"
        return "oracle" if self.kind == "oracle" else f"noisy:{self.p:g}"


def parse_drafter(spec: str) -> DrafterSpec:
    """"oracle" | "noisy:P" (P in [0, 1], the per-position rank-0 hit rate) | "dflash" (the trained drafter
    beside the model) | "dflash:DIR" -> DrafterSpec."""
    if not isinstance(spec, str):
        raise ValueError(f"drafter must be a string like 'oracle', 'noisy:0.6' or 'dflash', got {spec!r}")
    text = spec.strip().lower()
    if text == "oracle":
        return DrafterSpec("oracle")
    if text == "dflash":
        return DrafterSpec("dflash")
    if text.startswith("dflash:"):
        path = spec.strip()[len("dflash:"):]
        if not path:
            raise ValueError(f"drafter {spec!r}: dflash:DIR needs a directory")
        return DrafterSpec("dflash", path=str(Path(path)))
    if text.startswith("noisy:"):
        try:
            p = float(text.split(":", 1)[1])
        except ValueError:
            p = float("nan")
        if not 0.0 <= p <= 1.0:  # also rejects NaN
            raise ValueError(f"drafter {spec!r}: noisy hit rate must be a number in [0, 1]")
        return DrafterSpec("noisy", p)
    raise ValueError(f"unknown drafter {spec!r}: expected 'oracle', 'noisy:P' with P in [0, 1], 'dflash' or "
                     f"'dflash:DIR'")


def drafter_metadata(drafter, config) -> dict:
    """What a trace records of a run's drafter (traces.writer.RunMetadata.drafter): its name and, for a trained
    block drafter, its configuration and the digest of its weights; {} without one."""
    if drafter is None:
        return {}
    if isinstance(drafter, BlockDrafter):
        return {"name": drafter.name, "config": drafter.cfg.to_dict(), "digest": drafter.digest}
    return {"name": str(config.drafter or type(drafter).__name__)}

