"""The decode loops: autoregressive (AR) and DDTree speculative decoding, over any model with the model protocol.

Two seams keep the loop backend-agnostic:
- ``model``: the protocol of docs/architecture.md (cfg, new_cache, forward, commit, compact): the float64
  golden (engine.golden.model.ReferenceModel) or the device model.
- ``tree_ops``: choose tokens from logits, build the draft tree, accept. ``ReferenceTreeOps`` wraps the plain
  Python references; engine.device.tree_ops.DeviceTreeOps runs them on the kernels.

A DDTree step (docs/ddtree.md): draft -> build -> verify -> accept -> compact. The bonus token b sits at
position P (the committed prefix length); depth d of the tree is position P+d. The step commits tau tokens:
the accepted drafted tokens and then the new bonus. The prefill over the prompt produces the first bonus.
"""
from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Optional

import numpy as np

from kdspec.engine.decode.config import DecodeConfig
from kdspec.engine.decode.records import (GoldenCompare, OneNodeTree, StepOutcome, TreeTokens, read_target,
                                          step_record)
from kdspec.engine.golden import ddtree as ddtree_ref
from kdspec.engine.golden import sampling as sampling_ref
from kdspec.traces.schema import STAGES, TARGET_TOPK


class ReferenceTreeOps:
    """Token choice, tree build and accept by the plain Python references (engine.golden.ddtree, sampling)."""

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
    """tokens int64 [max_new_tokens] (the new tokens); config: the settings the run used
    (DecodeConfig.resolved); steps: verify steps after the prefill (AR: one per token after the first); taus:
    acceptance length of each step (AR: 1); stage_times: seconds per STAGES name, summed."""

    tokens: np.ndarray
    config: DecodeConfig
    steps: int
    taus: list[int]
    stage_times: dict[str, float]
    prefill_time: float
    elapsed: float
    golden_match: Optional[bool] = None
    meta: dict = field(default_factory=dict)

    @property
    def mode(self) -> str:
        return self.config.mode

    @property
    def mean_tau(self) -> float:
        """Mean acceptance length (tokens per verify step, the root counted); 0.0 when no step ran."""
        return float(np.mean(self.taus)) if self.taus else 0.0


def check_prompt(cfg, prompt_ids, max_new_tokens: int, max_cache_rows: Optional[int] = None) -> np.ndarray:
    """The prompt as int64 [P0], checked against the model (ids in the vocabulary, prompt + max_new_tokens
    within the positions and the cache). Raises ValueError with a one-line message."""
    vocab = cfg.vocab_size
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
    return prompt.astype(np.int64)


def check_drafter(drafter, config: DecodeConfig) -> None:
    """Raise ValueError unless ``drafter`` drafts the L = block_size - 1 depths of K = topk candidates of the
    resolved ``config``."""
    if drafter is None or not callable(getattr(drafter, "draft", None)):
        raise ValueError("mode 'ddtree' needs a drafter (an object with draft(committed, bonus, position))")
    if drafter.num_depths != config.num_depths or drafter.top_k != config.topk:
        raise ValueError(f"drafter drafts L={drafter.num_depths} depths x K={drafter.top_k}, but block_size "
                         f"{config.block_size} and topk {config.topk} need L={config.num_depths} x K={config.topk}")


@dataclass
class _Run:
    """What every step of one run shares."""

    model: Any
    cache: Any
    ops: Any
    prompt: np.ndarray
    config: DecodeConfig
    drafter: Any
    device_steps: Any = None  # engine.device.step.DeviceSteps: whole steps on the device (None: stage by stage)
    choice_topk: int = TARGET_TOPK  # the top-k a step on the device computes: 1 (the choice) unless records read it
    records: bool = True  # whether the steps' records are built (on_step given): what only they read is read then
    _committed: Optional[np.ndarray] = None  # committed_tokens' buffer and how much of it is filled
    _filled: int = 0

    def committed_tokens(self, tokens: list[int]) -> np.ndarray:
        """The tokens in the cache, prompt + tokens[:-1] (the last token is the bonus, not yet committed), as a
        view of one buffer into which only the tokens new since the last call are copied: a step's host time
        must not grow with the output."""
        count = len(self.prompt) + len(tokens) - 1
        if self._committed is None or count > len(self._committed):
            grown = np.empty(max(2 * count, 64), dtype=np.int64)
            grown[:len(self.prompt)] = self.prompt
            if self._committed is not None:
                grown[:self._filled] = self._committed[:self._filled]
            self._committed, self._filled = grown, max(self._filled, len(self.prompt))
        if count > self._filled:
            self._committed[self._filled:count] = tokens[self._filled - len(self.prompt):len(tokens) - 1]
            self._filled = count
        view = self._committed[:count]
        view.flags.writeable = False  # the drafter reads it; the buffer is the run's
        return view


def generate(model, prompt_ids, config: DecodeConfig, drafter=None, *, golden=None,
             on_step: Optional[Callable[[dict], None]] = None, tree_ops=None) -> GenerateResult:
    """Decode ``config.max_new_tokens`` after ``prompt_ids`` with ``model`` (model protocol).

    Args:
        config: the settings (DecodeConfig; resolved here against the model's vocabulary).
        drafter: mode "ddtree": drafts L = block_size - 1 depths of K = topk candidates (drafters.py).
        golden: an engine.golden.model.GoldenRun of the same prompt (optional): records then carry golden
            agreement.
        on_step: called with each step's record dict (records.py); records are built only when given.
        tree_ops: choose_tokens / build_tree / accept implementation (default ReferenceTreeOps).
    T = 0 is greedy; T > 0 Gumbel-max with noise keyed by (seed, absolute position of the chosen token), so
    DDTree and AR sample the same tokens.
    """
    cfg = model.cfg
    config = config.resolved(cfg.vocab_size)
    max_rows = getattr(model, "max_cache_rows", None)
    prompt = check_prompt(cfg, prompt_ids, config.max_new_tokens, max_rows)
    if config.mode == "ddtree":
        check_drafter(drafter, config)
    started = time.perf_counter()
    # Rows for the committed tokens plus one tree; never more than positions exist (the reference refuses).
    capacity = min(len(prompt) + config.max_new_tokens + config.budget, cfg.max_position_embeddings,
                   max_rows or cfg.max_position_embeddings)
    hidden_layers = tuple(getattr(drafter, "hidden_layers", ()) or ()) if config.mode == "ddtree" else ()
    cache = model.new_cache(capacity, hidden_layers=hidden_layers) if hidden_layers else model.new_cache(capacity)
    run = _Run(model, cache, tree_ops or ReferenceTreeOps(), prompt, config, drafter)
    device_steps = getattr(run.ops, "device_steps", None)
    run.device_steps = device_steps(model, cache, config.temperature) if device_steps is not None else None
    run.records = on_step is not None
    run.choice_topk = TARGET_TOPK if run.records else 1
    logits = model.forward(run.cache, prompt, np.arange(len(prompt), dtype=np.int64))
    model.commit(run.cache, len(prompt))
    bonus = int(run.ops.choose_tokens(logits[-1:], config.temperature, config.seed, np.array([len(prompt)]))[0])
    prefill_time = time.perf_counter() - started
    tokens, taus, stage_times = _steps(run, bonus, golden, on_step)
    output = np.asarray(tokens[:config.max_new_tokens], dtype=np.int64)  # the last step may overshoot: cut
    golden_match = None
    if golden is not None:
        reference = np.asarray(golden.tokens)[:config.max_new_tokens]
        golden_match = len(reference) == config.max_new_tokens and bool(np.array_equal(output, reference))
    return GenerateResult(tokens=output, config=config, steps=len(taus), taus=taus, stage_times=stage_times,
                          prefill_time=prefill_time, elapsed=time.perf_counter() - started,
                          golden_match=golden_match, meta=dict(prompt_len=len(prompt)))


def _steps(run: _Run, bonus: int, golden, on_step) -> tuple[list[int], list[int], dict[str, float]]:
    """Steps until max_new_tokens are committed: (tokens from the prefill's on, taus, stage times summed).

    A step's record is finished and handed to on_step (the trace writer) while the next step's forward runs on
    the GPU: the forward is queued, the host writes, then waits for the GPU. Only the host work that needs the
    device (the top-k of the logits) is done before the step ends; a golden comparison reads full logits and
    cache rows, so with a golden run (or record_logits) records are emitted at once."""
    config = run.config
    compare = None if golden is None else GoldenCompare(golden, len(run.prompt), run.cache)
    at_once = golden is not None or config.record_logits
    step_fn = _ar_step if config.mode == "ar" else _ddtree_step
    tokens, taus = [bonus], []
    stage_times = dict.fromkeys(STAGES, 0.0)
    pending = []

    def emit_pending():
        while pending:  # in step order (at most one waits in practice)
            on_step(pending.pop(0)())

    collecting = gc.isenabled()
    gc.disable()  # a cyclic collection over the heap of torch and numba objects takes milliseconds in one step
    try:
        while len(tokens) < config.max_new_tokens:
            step = step_fn(run, tokens, emit_pending)
            tokens.extend(step.committed)
            taus.append(len(step.accepted))
            for stage in STAGES:
                stage_times[stage] += step.times[stage]
            if on_step is not None:
                target = read_target(step, accepted_rows=at_once)  # device reads now; the rest when emitted
                pending.append(partial(step_record, step, target, compare, config.record_logits))
                if at_once:
                    emit_pending()
    finally:  # the last step's record (also when a later step failed)
        if collecting:
            gc.enable()
        if on_step is not None:
            emit_pending()
    return tokens, taus, stage_times


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


def _ar_step(run: _Run, tokens: list[int], after_forward: Callable[[], None]) -> StepOutcome:
    """Feed the last token (position P), commit it, choose the token at P+1: a one-node tree, tau 1, the chosen
    token as the bonus. ``after_forward`` runs once the forward is queued."""
    model, cache, config = run.model, run.cache, run.config
    clock = _Clock()
    prefix_len = cache.length
    root = tokens[-1]
    accepted = np.zeros(1, dtype=np.int32)
    if run.device_steps is not None:  # forward, choice and commit queued as one step on the device
        with clock("verify"):
            run.device_steps.ar(cache, root, run.choice_topk)
        after_forward()
        with clock("accept"):
            logits, choice = run.device_steps.finish_ar(logits=run.records)
        if not run.records:
            return StepOutcome(prefix_len, root, TreeTokens(np.array([root])), None, choice, accepted, int(choice[0]),
                               None, cache_len_verify=prefix_len + 1, cache_len_after=cache.length, times=clock.times)
        with clock("compact"):
            moves = ddtree_ref.compaction_moves(prefix_len, accepted)
        return StepOutcome(prefix_len, root, OneNodeTree(root), logits, choice, accepted, int(choice[0]), moves,
                           cache_len_verify=prefix_len + 1, cache_len_after=cache.length, times=clock.times)
    with clock("verify"):
        logits = model.forward(cache, np.array([root], dtype=np.int64), np.array([prefix_len], dtype=np.int64))
    after_forward()  # outside the stage clocks: the step's timings stay its own
    with clock("accept"):
        choice = run.ops.choose_tokens(logits, config.temperature, config.seed, np.array([prefix_len + 1]))
    with clock("compact"):
        moves = ddtree_ref.compaction_moves(prefix_len, accepted)
        model.commit(cache, 1)
    return StepOutcome(prefix_len, root, OneNodeTree(root), logits, choice, accepted, int(choice[0]), moves,
                       cache_len_verify=prefix_len + 1, cache_len_after=cache.length, times=clock.times)


def _ddtree_step(run: _Run, tokens: list[int], after_forward: Callable[[], None]) -> StepOutcome:
    """One draft -> build -> verify -> accept -> compact step. ``after_forward`` runs once the verify is
    queued."""
    model, cache, config, ops = run.model, run.cache, run.config, run.ops
    clock = _Clock()
    prefix_len = cache.length
    root = tokens[-1]
    with clock("draft"):
        committed_before = run.committed_tokens(tokens)
        # a drafter that names hidden layers reads them from the cache (the narrow interface of drafters.py)
        context = {"cache": cache} if getattr(run.drafter, "hidden_layers", ()) else {}
        draft_ids, draft_logprobs = run.drafter.draft(committed_before, root, prefix_len, **context)
    # Near the end of the position range / cache, the tree is cut to what fits (never in the tests' runs).
    depth_limit = min(draft_ids.shape[0], model.cfg.max_position_embeddings - 1 - prefix_len)
    node_budget = min(config.budget, cache.capacity - prefix_len - 1)
    if run.device_steps is not None:
        # build, verify, accept and compact queued as one step on the device: "build" is the host's uploads and
        # launch, "verify" the wait for the step's results (the GPU time of all four stages), "compact" the
        # host's bookkeeping of the moves
        with clock("build"):
            run.device_steps.ddtree(cache, draft_logprobs[:depth_limit], draft_ids[:depth_limit], root, node_budget,
                                    run.choice_topk)
        after_forward()
        with clock("verify"):
            if run.records:
                tree, logits, choice, accepted, bonus = run.device_steps.finish()
            else:
                tree_tokens, accepted, bonus = run.device_steps.finish_path()
                tree, logits, choice = TreeTokens(tree_tokens), None, None
        with clock("compact"):
            moves = ddtree_ref.compaction_moves(prefix_len, accepted) if run.records else None
        return StepOutcome(prefix_len, root, tree, logits, choice, accepted, int(bonus), moves,
                           cache_len_verify=prefix_len + tree.num_nodes, cache_len_after=cache.length,
                           times=clock.times, draft=(draft_ids, draft_logprobs))
    with clock("build"):
        tree = ops.build_tree(draft_logprobs[:depth_limit], draft_ids[:depth_limit], root, node_budget, prefix_len)
    with clock("verify"):
        logits = model.forward(cache, tree.tokens, tree.positions, tree.visibility)
    after_forward()  # outside the stage clocks: the step's timings stay its own
    with clock("verify"):
        # node i's choice is the token at position P + depth_i + 1
        choice = ops.choose_tokens(logits, config.temperature, config.seed, tree.positions + 1)
    with clock("accept"):
        accepted, bonus = ops.accept(tree.parents, tree.tokens, choice)
    cache_len_verify = cache.length + tree.num_nodes
    with clock("compact"):
        moves = ddtree_ref.compaction_moves(prefix_len, accepted)
        model.compact(cache, accepted)
    return StepOutcome(prefix_len, root, tree, logits, choice, np.asarray(accepted, dtype=np.int32), int(bonus),
                       moves, cache_len_verify=cache_len_verify, cache_len_after=cache.length, times=clock.times,
                       draft=(draft_ids, draft_logprobs))
