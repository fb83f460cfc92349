"""The trace schema: one table of what every per-step field is, and the fixed widths it is padded to.

A trace holds one row per speculative step in a single compound dataset ``steps`` (one HDF5 write per
step: measured ~6x cheaper than one dataset per field). Each row has the fields of the DDTree step
record (docs/architecture.md) under the record's names, variable-length fields padded to a fixed width:

    node fields  [B+1]        tree_* / target_* (N+1 <= B+1 nodes), padding -1 / NaN, length num_nodes
    path fields  [L+1]        accepted / committed / golden / diff / compact (tau <= L+1), length tau
    draft fields [L, K]       drafter top-K per depth (absent from the row when L*K == 0, e.g. AR runs)
    topk fields  [B+1, T]     target's top-T (T = 8) per node

Dimension letters: L drafted depths (block_size - 1), K drafter top-K, B node budget (non-root nodes),
N+1 tree nodes, T target top-k, V vocabulary. docs/trace-format.md documents every field.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

FORMAT_NAME = "kdtree-trace"
SCHEMA_VERSION = 1
TARGET_TOPK = 8
STAGES = ("draft", "build", "verify", "accept", "compact")
MODES = ("ar", "ddtree")


class TraceError(Exception):
    """A trace that cannot be written or read; the message is one line naming the file (and dataset)."""


@dataclass(frozen=True)
class Field:
    """One per-step field: ``kind`` gives its padded shape (see ``TraceDims.shape``)."""

    name: str
    kind: str    # "scalar" | "node" | "path" | "draft" | "topk"
    dtype: str   # numpy dtype string of the stored value
    unit: str
    meaning: str

    @property
    def pad(self):
        """Fill value of padding (and of unset scalars): -1 for integers, NaN for floats."""
        return -1 if np.dtype(self.dtype).kind == "i" else np.nan


# Order is the on-disk field order of a ``steps`` row.
STEP_FIELDS: tuple[Field, ...] = (
    Field("prefix_len", "scalar", "i8", "tokens", "P, committed tokens in the cache before the step"),
    Field("root_token", "scalar", "i4", "token id", "bonus token b carried into the step (node 0, position P)"),
    Field("num_nodes", "scalar", "i4", "nodes", "N+1, tree nodes including the root (length of node fields)"),
    Field("tau", "scalar", "i4", "tokens", "acceptance length, counts the root (length of path fields); 0 = row not written"),
    Field("bonus_token", "scalar", "i4", "token id", "target's choice at the last accepted node"),
    Field("cache_len_before", "scalar", "i8", "rows", "cache length before verify (P)"),
    Field("cache_len_verify", "scalar", "i8", "rows", "cache length after the verify forward wrote the tree (P+N+1)"),
    Field("cache_len_after", "scalar", "i8", "rows", "cache length after compaction (P+tau)"),
    Field("cache_max_abs_diff", "scalar", "f4", "activation units",
          "max |engine - golden AR cache| over the compacted rows (NaN: not measured)"),
    Field("time_draft", "scalar", "f8", "s", "drafter wall time"),
    Field("time_build", "scalar", "f8", "s", "tree build wall time"),
    Field("time_verify", "scalar", "f8", "s", "target verify forward wall time"),
    Field("time_accept", "scalar", "f8", "s", "greedy accept wall time"),
    Field("time_compact", "scalar", "f8", "s", "KV cache compaction wall time"),
    Field("time_trace_write_prev", "scalar", "f8", "s",
          "wall time of writing the PREVIOUS step's row (NaN in row 0); the reader shifts it back"),
    Field("draft_ids", "draft", "i4", "token id", "drafter top-K token ids per depth 1..L, by descending log-prob"),
    Field("draft_logprobs", "draft", "f4", "nats", "drafter top-K log-probs per depth, sorted descending"),
    Field("tree_tokens", "node", "i4", "token id", "token of each node (node 0 the root)"),
    Field("tree_parents", "node", "i4", "node index", "parent of each node (root -1; parent < node)"),
    Field("tree_depths", "node", "i4", "depth", "depth of each node (root 0); position = P + depth"),
    Field("tree_ranks", "node", "i4", "rank", "drafter rank of the node's token at its depth (root 0)"),
    Field("tree_scores", "node", "f4", "nats", "path log-prob under the draft distribution (root 0)"),
    Field("target_choice", "node", "i4", "token id", "target's next token at each node"),
    Field("target_margin", "node", "f4", "logit", "target's top-1 minus top-2 logit at each node"),
    Field("target_topk_ids", "topk", "i4", "token id", "target's top-T token ids at each node"),
    Field("target_topk_logits", "topk", "f4", "logit", "target's top-T logits at each node"),
    Field("accepted_nodes", "path", "i4", "node index", "accepted path from the root (starts with 0)"),
    Field("committed_tokens", "path", "i4", "token id",
          "tokens committed at positions P+1..P+tau (accepted tokens after the root, then the bonus)"),
    Field("golden_tokens", "path", "i4", "token id", "golden reference tokens at those positions"),
    Field("logit_max_abs_diff", "path", "f4", "logit",
          "max over the vocabulary of |engine - golden logits| per committed position (NaN: not measured)"),
    Field("compact_src", "path", "i4", "cache row", "compaction moves: source row P+accepted[j]"),
    Field("compact_dst", "path", "i4", "cache row", "compaction moves: destination row P+j"),
)
FIELDS_BY_NAME = {f.name: f for f in STEP_FIELDS}
# Record keys beyond the row's fields, stored (with save_logits) in datasets of their own [S, L+1, V]:
# the engine's logits at the committed positions and, when the run has a golden, the golden's there.
LOGITS_KEYS = ("logits", "golden_logits")
# The record fields the writer derives itself (lengths) or measures (its own write time).
DERIVED_FIELDS = ("num_nodes", "tau", "time_trace_write_prev")
SCALAR_COLUMNS = tuple(f.name for f in STEP_FIELDS if f.kind == "scalar" and f.name != "time_trace_write_prev")
# Columns the reader offers: the scalars plus the un-shifted write time of each step.
COLUMNS = SCALAR_COLUMNS + ("time_trace_write",)
TIME_COLUMNS = tuple(f"time_{s}" for s in STAGES) + ("time_trace_write",)


@dataclass(frozen=True)
class TraceDims:
    """Fixed widths of a trace: L drafted depths, K drafter top-K, B node budget, T target top-k."""

    num_depths: int
    draft_topk: int
    budget: int
    target_topk: int = TARGET_TOPK

    def __post_init__(self) -> None:
        for name in ("num_depths", "draft_topk", "budget"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or value < 0:
                raise TraceError(f"{name} must be an integer >= 0, got {value!r}")
        if not isinstance(self.target_topk, (int, np.integer)) or self.target_topk < 1:
            raise TraceError(f"target_topk must be an integer >= 1, got {self.target_topk!r}")

    @property
    def node_width(self) -> int:
        return self.budget + 1

    @property
    def path_width(self) -> int:
        return self.num_depths + 1

    @property
    def has_draft(self) -> bool:
        return self.num_depths * self.draft_topk > 0

    def shape(self, kind: str) -> tuple[int, ...]:
        """Padded per-step shape of a field of this kind."""
        return {"scalar": (), "node": (self.node_width,), "path": (self.path_width,),
                "draft": (self.num_depths, self.draft_topk),
                "topk": (self.node_width, self.target_topk)}[kind]

    def fields(self) -> tuple[Field, ...]:
        """The fields a row holds (draft fields only when L*K > 0: HDF5 has no zero-size members)."""
        return tuple(f for f in STEP_FIELDS if f.kind != "draft" or self.has_draft)

    def row_dtype(self) -> np.dtype:
        """Compound numpy dtype of one ``steps`` row (packed, little-endian)."""
        return np.dtype([(f.name, "<" + f.dtype, self.shape(f.kind)) for f in self.fields()])

    def blank_row(self) -> np.ndarray:
        """A one-element row array with every field set to its padding."""
        row = np.zeros(1, self.row_dtype())
        for f in self.fields():
            row[f.name] = f.pad
        return row
