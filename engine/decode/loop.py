"""The decode loops: autoregressive (AR) and DDTree speculative decoding, over any model with the model protocol.

Two seams keep the loop backend-agnostic:
- ``model``: the protocol of docs/architecture.md (cfg, new_cache, forward, commit, compact): the float64
  golden (engine.reference.ReferenceModel) or the device model.
- ``tree_ops``: choose tokens from logits, build the draft tree, accept. ``ReferenceTreeOps`` wraps the plain
  Python references; a device version (numba_kernels tree_build / tree_accept / sampling) slots in later.

A DDTree step (docs/ddtree.md): draft -> build -> verify -> accept -> compact. The bonus token b sits at
position P (the committed prefix length); depth d of the tree is position P+d. The step commits tau tokens:
the accepted drafted tokens and then the new bonus. The prefill over the prompt produces the first bonus.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

from kdspec.engine.decode.records import ar_step_record, ddtree_step_record, target_topk
from kdspec.engine.golden import ddtree as ddtree_ref
from kdspec.engine.golden import sampling as sampling_ref

STAGES = ("draft", "build", "verify", "accept", "compact")
MODES = ("ar", "ddtree")


class ReferenceTreeOps:
    """Token choice, tree build and accept by the plain Python references (engine.ddtree_ref, sampling_ref)."""

    @staticmethod
    def choose_tokens(logits: np.ndarray, temperature: float, seed: int, positions: np.ndarray) -> np.ndarray:
        """logits [s, V], positions [s] of the tokens being chosen -> int64 [s] (argmax, or Gumbel-max at T>0)."""
        return sampling_ref.choose_tokens(logits, temperature, seed, positions)

    @staticmethod
    def build_tree(draft_logprobs, draft_ids, root_token: int, budget: int, prefix_len: int) -> ddtree_ref.Tree:
        return ddtree_ref.build_tree(draft_logprobs, draft_ids, root_token, budget, prefix_len)

    @staticmethod
    def accept(parents, tokens, target_choice) -> tuple[np.ndarray, int]:
        return ddtree_ref.accept(parents, tokens, target_choice)


@dataclass
class GenerateResult:
    """tokens int64 [max_new_tokens] (the new tokens); steps: verify steps after the prefill (AR: one per token
    after the first); taus: acceptance length of each step (AR: 1); stage_times: seconds per STAGES name, summed."""

    tokens: np.ndarray
    mode: str
    steps: int
    taus: list[int]
    stage_times: dict[str, float]
    prefill_time: float
    elapsed: float
    golden_match: Optional[bool] = None
    meta: dict = field(default_factory=dict)

    @property
    def mean_tau(self) -> float:
        """Mean acceptance length (tokens per verify step, the root counted); 0.0 when no step ran."""
        return float(np.mean(self.taus)) if self.taus else 0.0


def _check_int(name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return int(value)


def check_generate_args(cfg, prompt_ids, max_new_tokens, mode, block_size, budget, topk, temperature, seed,
                        max_cache_rows: Optional[int] = None) -> tuple[np.ndarray, int]:
    """Validate everything but the drafter before any model work; return (prompt int64 [P0], topk).
    Raises ValueError with a one-line message."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    _check_int("max_new_tokens", max_new_tokens, 1)
    _check_int("block_size", block_size, 1)
    _check_int("budget", budget, 1)
    _check_int("seed", seed, 0)
    vocab = cfg.vocab_size
    topk = min(budget, vocab) if topk is None else _check_int("topk", topk, 1)
    if topk > vocab:
        raise ValueError(f"topk must be at most the vocabulary size {vocab}, got {topk}")
    if not isinstance(temperature, (int, float, np.floating)) or not temperature >= 0 or not np.isfinite(temperature):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    prompt = np.asarray(prompt_ids)
    if prompt.ndim != 1 or prompt.size == 0:
        raise ValueError(f"prompt must be a non-empty 1-D sequence of token ids, got shape {prompt.shape}")
    if not np.issubdtype(prompt.dtype, np.integer):
        raise ValueError(f"prompt token ids must be integers, got dtype {prompt.dtype}")
    if prompt.min() < 0 or prompt.max() >= vocab:
        bad = int(prompt[(prompt < 0) | (prompt >= vocab)][0])
        raise ValueError(f"prompt token id {bad} is outside the vocabulary 0..{vocab - 1}")
    total = len(prompt) + max_new_tokens
    if total > cfg.max_position_embeddings:
        raise ValueError(f"prompt ({len(prompt)}) + max_new_tokens ({max_new_tokens}) = {total} exceeds "
                         f"max_position_embeddings {cfg.max_position_embeddings}")
    if max_cache_rows is not None and total > max_cache_rows:
        raise ValueError(f"prompt ({len(prompt)}) + max_new_tokens ({max_new_tokens}) = {total} exceeds the "
                         f"model's cache capacity of {max_cache_rows} rows")
    return prompt.astype(np.int64), topk


def check_drafter(drafter, block_size: int, topk: int) -> None:
    """Raise ValueError unless ``drafter`` drafts L = block_size - 1 depths of K = topk candidates."""
    if drafter is None or not callable(getattr(drafter, "draft", None)):
        raise ValueError("mode 'ddtree' needs a drafter (an object with draft(committed, bonus, position))")
    if drafter.num_depths != block_size - 1 or drafter.top_k != topk:
        raise ValueError(f"drafter drafts L={drafter.num_depths} depths x K={drafter.top_k}, but block_size "
                         f"{block_size} and topk {topk} need L={block_size - 1} x K={topk}")


def generate(model, prompt_ids, max_new_tokens: int, mode: str = "ar", drafter=None, block_size: int = 8,
             budget: int = 7, topk: Optional[int] = None, temperature: float = 0.0, seed: int = 0, golden=None,
             on_step: Optional[Callable[[dict], None]] = None, tree_ops=None,
             record_logits: bool = False) -> GenerateResult:
    """Decode ``max_new_tokens`` after ``prompt_ids`` with ``model`` (model protocol).

    Args:
        mode: "ar" (one forward per token) or "ddtree" (drafter + tree verify, block_size = L + 1, budget B
            non-root nodes, drafter top-K = topk, default min(B, V)).
        temperature, seed: T = 0 greedy; T > 0 Gumbel-max with noise keyed by (seed, absolute position of the
            chosen token), so DDTree and AR sample the same tokens.
        golden: an engine.reference.GoldenRun of the same prompt (optional): records then carry golden agreement.
        on_step: called with each step's record dict (docs/architecture.md); records are built only when given.
        tree_ops: choose_tokens / build_tree / accept implementation (default ReferenceTreeOps).
        record_logits: records also carry ``logits`` float32 [tau, V], the full logits of the committed
            positions (for traces of small vocabularies).
    """
    cfg = model.cfg
    prompt, topk = check_generate_args(cfg, prompt_ids, max_new_tokens, mode, block_size, budget, topk,
                                       temperature, seed, getattr(model, "max_cache_rows", None))
    if mode == "ddtree":
        check_drafter(drafter, block_size, topk)
    ops = tree_ops or ReferenceTreeOps()
    prompt_len = len(prompt)
    # Rows for the committed tokens plus one tree; never more than positions exist (the reference refuses).
    capacity = prompt_len + max_new_tokens + (budget if mode == "ddtree" else 0)
    capacity = min(capacity, cfg.max_position_embeddings, getattr(model, "max_cache_rows", None) or capacity)
    started = time.perf_counter()
    cache = model.new_cache(capacity)

    logits = model.forward(cache, prompt, np.arange(prompt_len, dtype=np.int64))
    model.commit(cache, prompt_len)
    bonus = int(ops.choose_tokens(logits[-1:], temperature, seed, np.array([prompt_len]))[0])
    prefill_time = time.perf_counter() - started

    tokens = [bonus]
    taus: list[int] = []
    stage_times = dict.fromkeys(STAGES, 0.0)
    step_fn = _ar_step if mode == "ar" else _ddtree_step
    # A step's record is finished and handed to on_step (the trace writer) while the next step's forward runs
    # on the GPU: the forward is queued, the host writes, then waits for the GPU. Only the host work that needs
    # the device (the top-k of the logits) is done before the step ends; a golden comparison reads full logits
    # and cache rows, so with a golden run records are emitted at once.
    pending = []

    def emit_pending():
        while pending:  # in step order (at most one waits in practice)
            on_step(pending.pop(0)())

    want_record = (on_step is not None) and ("logits" if record_logits else True)
    try:
        while len(tokens) < max_new_tokens:
            committed, times, record = step_fn(model, cache, ops, prompt, tokens, drafter=drafter, budget=budget,
                                               temperature=temperature, seed=seed, golden=golden,
                                               want_record=want_record, after_forward=emit_pending)
            tokens.extend(committed)
            taus.append(len(committed))
            for stage in STAGES:
                stage_times[stage] += times[stage]
            if record is not None:
                pending.append(record)
                if golden is not None or record_logits:
                    emit_pending()
    finally:  # the last step's record (also when a later step failed)
        emit_pending()
    output = np.asarray(tokens[:max_new_tokens], dtype=np.int64)  # the last step may overshoot: truncate
    golden_match = None
    if golden is not None:
        reference = np.asarray(golden.tokens)[:max_new_tokens]
        golden_match = len(reference) == max_new_tokens and bool(np.array_equal(output, reference))
    return GenerateResult(tokens=output, mode=mode, steps=len(taus), taus=taus, stage_times=stage_times,
                          prefill_time=prefill_time, elapsed=time.perf_counter() - started,
                          golden_match=golden_match,
                          meta=dict(block_size=block_size, budget=budget, topk=topk, temperature=temperature,
                                    seed=seed, prompt_len=prompt_len, max_new_tokens=max_new_tokens))


class _Clock:
    """Wall time per stage: ``with clock("verify"): ...``."""

    def __init__(self):
        self.times = dict.fromkeys(STAGES, 0.0)
        self._stage, self._start = None, 0.0

    def __call__(self, stage: str) -> "_Clock":
        self._stage = stage
        return self

    def __enter__(self):
        self._start = time.perf_counter()

    def __exit__(self, *exc):
        self.times[self._stage] += time.perf_counter() - self._start


def _ar_step(model, cache, ops, prompt, tokens, *, temperature, seed, golden, want_record, after_forward, **_):
    """Feed the last token (position P), commit it, choose the token at P+1. Returns ([token], times, record),
    record: None or a function building the step record. ``after_forward`` runs once the forward is queued."""
    clock = _Clock()
    prefix_len = cache.length
    root = tokens[-1]
    with clock("verify"):
        logits = model.forward(cache, np.array([root], dtype=np.int64), np.array([prefix_len], dtype=np.int64))
    after_forward()  # outside the stage clocks: the step's timings stay its own
    with clock("accept"):
        choice = ops.choose_tokens(logits, temperature, seed, np.array([prefix_len + 1]))
    with clock("compact"):
        model.commit(cache, 1)
    record = None
    if want_record:
        topk, length = target_topk(logits), cache.length  # device reads now; the rest when emitted
        full = np.asarray(logits, dtype=np.float32) if want_record == "logits" else None

        def record():
            built = ar_step_record(prefix_len, root, logits, choice, clock.times, cache, prompt, golden, topk,
                                   length)
            if full is not None:
                built["logits"] = full
            return built
    return [int(choice[0])], clock.times, record


def _ddtree_step(model, cache, ops, prompt, tokens, *, drafter, budget, temperature, seed, golden, want_record,
                 after_forward):
    """One draft -> build -> verify -> accept -> compact step. Returns (committed tokens [tau], times, record),
    record: None or a function building the step record. ``after_forward`` runs once the verify is queued."""
    cfg = model.cfg
    clock = _Clock()
    prefix_len = cache.length
    root = tokens[-1]
    with clock("draft"):
        committed_before = np.concatenate([prompt, np.asarray(tokens[:-1], dtype=np.int64)])
        draft_ids, draft_logprobs = drafter.draft(committed_before, root, prefix_len)
    with clock("build"):
        # Near the end of the position range / cache, the tree is cut to what fits (never in the tests' runs).
        depth_limit = min(draft_ids.shape[0], cfg.max_position_embeddings - 1 - prefix_len)
        node_budget = min(budget, cache.capacity - prefix_len - 1)
        tree = ops.build_tree(draft_logprobs[:depth_limit], draft_ids[:depth_limit], root, node_budget, prefix_len)
    with clock("verify"):
        logits = model.forward(cache, tree.tokens, tree.positions, tree.visibility)
    after_forward()  # outside the stage clocks: the step's timings stay its own
    with clock("verify"):
        # node i's choice is the token at position P + depth_i + 1
        choice = ops.choose_tokens(logits, temperature, seed, tree.positions + 1)
    with clock("accept"):
        accepted, bonus = ops.accept(tree.parents, tree.tokens, choice)
    cache_len_verify = cache.length + tree.num_nodes
    with clock("compact"):
        model.compact(cache, accepted)
    committed = [int(t) for t in tree.tokens[accepted[1:]]] + [int(bonus)]
    record = None
    if want_record:
        topk, length = target_topk(logits), cache.length  # device reads now; the rest when emitted
        full = np.asarray(logits, dtype=np.float32)[accepted] if want_record == "logits" else None

        def record():
            built = ddtree_step_record(prefix_len, root, draft_ids, draft_logprobs, tree, logits, choice, accepted,
                                       bonus, committed, cache_len_verify, clock.times, cache, prompt, golden, topk,
                                       length)
            if full is not None:
                built["logits"] = full
            return built
    return committed, clock.times, record
