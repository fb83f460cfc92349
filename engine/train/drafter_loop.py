"""The drafter's training loop and its final held-out evaluation (drafter_train.py runs it).

One step: S training sequences, A anchors each (uniform over the usable anchors, drafter_data.py); the
sequences' tapped hidden states (cut to the largest anchor) are the context, the blocks [token at P, MASK x L]
are drafted in one forward under bf16 autocast; weighted cross-entropy (drafter_model.block_loss), gradient
clipping, AdamW. The held-out sequences are split in two: the first ``val_sequences`` are the validation set
(every ``eval_interval_s`` its fixed blocks give a chain tau; the best state by it is kept, and training stops
after ``patience`` checks without a better one), the rest are the reported held-out set. At the end the kept
weights are rounded to bf16 and scored in fp32 on the held-out blocks; then a softmax temperature is fitted on
the validation blocks (cross-entropy), folded into norm.weight, the weights rounded again (what is saved) and
scored again, next to two bigram chain drafters measured on the same blocks.
"""
from __future__ import annotations

import math
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F

from kdspec.engine.model.drafter import WEIGHTS_FILE, DrafterConfig
from kdspec.engine.model.safetensors_io import save_file

from .drafter_data import GeneratedSet, block_labels, build_sets, sample_anchors
from .drafter_eval import DraftScores, bigram_chain_logprobs, bigram_table, format_summary
from .drafter_model import BlockDrafter, bf16_state, block_loss, depth_weights, round_to_bf16
from .prepare import PreparedData


@dataclass
class DrafterResult:
    cfg: DrafterConfig
    recipe: object
    model: BlockDrafter
    data_summary: dict
    curve: list = field(default_factory=list)
    steps: int = 0
    blocks: int = 0
    train_seconds: float = 0.0
    eval_seconds: float = 0.0
    setup_seconds: float = 0.0
    final_eval_seconds: float = 0.0
    stop_reason: str = ""
    best_step: int = 0
    best_validation_tau: float = -math.inf
    heldout: dict = field(default_factory=dict)
    versions: dict = field(default_factory=dict)

    def save(self, out: Path) -> None:
        self.cfg.save(out)
        state = bf16_state(self.model)
        save_file(out / WEIGHTS_FILE, state, dtypes={name: "BF16" for name in state},
                  metadata={"format": "pt", "architecture": "kdtree-dflash"})

    def recipe_dict(self) -> dict:
        return asdict(self.recipe)

    def manifest_fields(self) -> dict:
        return {"loss_curve": self.curve,
                "loss_curve_fields": "train_loss: mean weighted loss (nats) of the steps since the previous point; "
                                     "ce_per_depth: their mean cross-entropy per depth; validation_tau: chain "
                                     "tau on the validation blocks (fp32); the checkpoint kept is the best by it; "
                                     "seconds: training clock",
                "steps": self.steps, "blocks": self.blocks, "stop_reason": self.stop_reason,
                "best_step": self.best_step, "best_validation_tau": self.best_validation_tau,
                "train_seconds": self.train_seconds, "eval_seconds": self.eval_seconds,
                "setup_seconds": self.setup_seconds, "final_eval_seconds": self.final_eval_seconds,
                "blocks_per_s": self.blocks / max(self.train_seconds, 1e-9), "heldout": self.heldout}


def learning_rate(recipe, step: int, progress: float) -> float:
    if step < recipe.warmup_steps:
        return recipe.lr * (step + 1) / recipe.warmup_steps
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(max(progress, 0.0), 1.0)))
    return recipe.lr * (recipe.min_lr_ratio + (1.0 - recipe.min_lr_ratio) * cosine)


def load_target(target_dir: Path, device: torch.device):
    """The frozen target in fp32 (its bf16 weights widened exactly), eval mode."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32,
                                                              attn_implementation="sdpa",
                                                              experts_implementation="eager")
    model.to(device).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def eval_blocks(gen: GeneratedSet, per_sequence: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed held-out blocks as [N, A] anchors and a validity mask: up to A distinct usable anchors per
    sequence (seeded); short rows repeat their first anchor, marked invalid."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    ok = gen.anchor_ok.cpu()
    anchors = torch.zeros(ok.shape[0], per_sequence, dtype=torch.long)
    valid = torch.zeros(ok.shape[0], per_sequence, dtype=torch.bool)
    for s in range(ok.shape[0]):
        cand = torch.nonzero(ok[s]).flatten()
        if len(cand) == 0:
            anchors[s] = gen.prompt_lengths[s].item()
            continue
        pick = cand[torch.randperm(len(cand), generator=g)[:per_sequence]].sort().values
        anchors[s, :len(pick)] = pick
        anchors[s, len(pick):] = pick[0]
        valid[s, :len(pick)] = True
    return anchors.to(gen.tokens.device), valid.to(gen.tokens.device)


def drafter_chunks(model: BlockDrafter, gen: GeneratedSet, anchors: torch.Tensor, valid: torch.Tensor,
                   embed: torch.Tensor, lm_head: torch.Tensor, seqs_per_chunk: int, logits: bool = False):
    """(log-probs [n, L, V] float32, targets [n, L]) over the valid evaluation blocks, ``seqs_per_chunk``
    sequences at a time, in fp32 (raw logits instead of log-probs with ``logits``)."""
    L = model.cfg.num_depths
    for start in range(0, anchors.shape[0], seqs_per_chunk):
        idx = torch.arange(start, min(start + seqs_per_chunk, anchors.shape[0]), device=anchors.device)
        a, v = anchors[idx], valid[idx]
        ctx = gen.hidden[idx, :max(int(a.max()), 1)].float()
        bonus = gen.tokens[idx[:, None], a]
        out = F.linear(model(ctx, a, bonus, embed), lm_head).float()
        out = out[v] if logits else torch.log_softmax(out, dim=-1)[v]
        yield out, block_labels(gen.tokens, idx, a, L)[v]


TEMPERATURES = tuple(float(t) for t in np.exp(np.linspace(np.log(0.5), np.log(4.0), 61)))


@torch.no_grad()
def fit_temperature(model, gen, anchors, valid, embed, lm_head) -> tuple[float, dict]:
    """The softmax temperature T (a grid over 0.5..4, log-spaced) minimising the mean cross-entropy of the target's
    token over every depth of the validation blocks. T is folded into the model as norm.weight / T (the logits
    are linear in it), so the drafter's forward (engine/model/drafter.py) is unchanged."""
    temps = torch.tensor(TEMPERATURES, device=anchors.device, dtype=torch.float64)
    nll = torch.zeros_like(temps)
    count = 0
    for logits, targets in drafter_chunks(model, gen, anchors, valid, embed, lm_head, 16, logits=True):
        target_logit = logits.gather(-1, targets[..., None])[..., 0]
        for i, t in enumerate(TEMPERATURES):
            nll[i] += (torch.logsumexp(logits / t, dim=-1) - target_logit / t).double().sum()
        count += targets.numel()
    nll /= max(count, 1)
    best = int(nll.argmin())
    return TEMPERATURES[best], {"temperature": TEMPERATURES[best], "validation_nll_at_T": float(nll[best]),
                                "validation_nll_at_1": float(nll[int((temps - 1).abs().argmin())]),
                                "grid": "61 log-spaced values in 0.5..4"}


def bigram_chunks(table: torch.Tensor, gen: GeneratedSet, anchors: torch.Tensor, valid: torch.Tensor, depths: int,
                  chunk: int = 2048):
    seq = torch.arange(anchors.shape[0], device=anchors.device)[:, None].expand_as(anchors)[valid]
    flat = anchors[valid]
    for start in range(0, len(flat), chunk):
        s, p = seq[start:start + chunk], flat[start:start + chunk]
        yield bigram_chain_logprobs(table, gen.tokens[s, p], depths), block_labels(gen.tokens, s, p, depths)


@torch.no_grad()
def quick_tau(model, gen, anchors, valid, embed, lm_head) -> float:
    """Chain tau on the validation blocks (fp32, the training run's matmul precision)."""
    was = model.training
    model.eval()
    scores = DraftScores(model.cfg.num_depths, tree_blocks=0)
    for lp, tg in drafter_chunks(model, gen, anchors, valid, embed, lm_head, 16):
        scores.add(lp, tg)
    model.train(was)
    return scores.report()["tau_chain"]


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_and_evaluate(cfg: DrafterConfig, recipe, target_dir: Path, data: PreparedData, device: torch.device,
                       time_budget: float, seed: int, max_steps: Optional[int],
                       log: Callable[[str], None]) -> DrafterResult:
    import transformers

    t_setup = time.perf_counter()
    torch.manual_seed(seed)
    sets = _generate_sets(cfg, recipe, target_dir, data, device, seed, log)
    model, optimizer = _new_drafter(cfg, recipe, device, seed)
    result = DrafterResult(cfg, recipe, model, sets.summary,
                           versions={"python": platform.python_version(), "torch": torch.__version__,
                                     "transformers": transformers.__version__})
    torch.set_float32_matmul_precision("high")
    result.setup_seconds = time.perf_counter() - t_setup
    best_state = _train(result, optimizer, sets, device, time_budget, seed, max_steps, log)
    _final_evaluation(result, best_state, sets, data, device, log)
    _log_run(result, device, log)
    return result


@dataclass
class _Sets:
    """The generated sets, the frozen target's embedding and head, and the fixed evaluation blocks."""

    train: GeneratedSet
    val: GeneratedSet
    heldout: GeneratedSet
    summary: dict
    embed: torch.Tensor
    lm_head: torch.Tensor
    usable: torch.Tensor      # training sequences with at least one usable anchor
    ev_anchors: torch.Tensor  # the held-out blocks ...
    ev_valid: torch.Tensor
    val_anchors: torch.Tensor  # ... and the validation blocks (eval_blocks)
    val_valid: torch.Tensor


def _generate_sets(cfg: DrafterConfig, recipe, target_dir: Path, data: PreparedData, device: torch.device,
                   seed: int, log: Callable[[str], None]) -> _Sets:
    """Load the target, generate the training / validation / held-out sets with it and fix the evaluation blocks;
    the target itself is dropped (only its embedding and head are kept)."""
    import transformers

    target = load_target(target_dir, device)
    if target.config.hidden_size != cfg.hidden_size:
        raise ValueError("target hidden size changed under us")
    log(f"device {device}; torch {torch.__version__}, transformers {transformers.__version__}; drafter "
        f"{cfg.num_layers} layers, {cfg.parameter_count():,} parameters, block {cfg.block_size}, target layers "
        f"{list(cfg.target_layers)}, gamma {recipe.gamma}")
    train, heldout_all = build_sets(
        target, data.train, data.heldout, recipe.train_sequences, recipe.val_sequences + recipe.heldout_sequences,
        recipe.new_tokens, recipe.prompt_min, recipe.prompt_max, recipe.gen_batch, cfg.num_depths, cfg.target_layers,
        seed, device, autocast=device.type == "cuda", time_budget=recipe.data_budget_s, log=log)
    val, heldout = heldout_all.rows(0, recipe.val_sequences), heldout_all.rows(recipe.val_sequences)
    summary = {"train": train.summary(), "validation": val.summary(), "heldout": heldout.summary(),
               "split": f"held-out sequences 0..{recipe.val_sequences - 1} choose the checkpoint (validation); "
                        f"the rest are the reported held-out set"}
    for name in ("train", "validation", "heldout"):
        log(f"{name} set {summary[name]}")
    usable = torch.nonzero(train.anchor_ok.any(1)).flatten()
    if len(usable) == 0:
        raise ValueError("no usable training anchors (sequences too short for the block?)")
    ev_anchors, ev_valid = eval_blocks(heldout, recipe.eval_anchors_per_sequence, seed)
    val_anchors, val_valid = eval_blocks(val, recipe.eval_anchors_per_sequence, seed + 1)
    return _Sets(train, val, heldout, summary, target.model.embed_tokens.weight.detach(),
                 target.lm_head.weight.detach(), usable, ev_anchors, ev_valid, val_anchors, val_valid)


def _new_drafter(cfg: DrafterConfig, recipe, device: torch.device, seed: int):
    """The freshly initialised drafter in training mode and its AdamW (weight decay on the matrices only)."""
    model = BlockDrafter(cfg)
    model.reset_parameters(seed)
    model.to(device).train()
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": recipe.weight_decay},
                                   {"params": rest, "weight_decay": 0.0}], lr=recipe.lr,
                                  betas=(recipe.beta1, recipe.beta2), fused=device.type == "cuda")
    return model, optimizer


@dataclass
class _Window:
    """Running sums over the training steps since the previous validation check."""

    loss_sum: torch.Tensor
    ce_sum: torch.Tensor
    steps: int = 0
    blocks: int = 0

    def reset(self) -> None:
        self.loss_sum.zero_()
        self.ce_sum.zero_()
        self.steps, self.blocks = 0, 0


def _train(result: DrafterResult, optimizer, sets: _Sets, device: torch.device, time_budget: float, seed: int,
           max_steps: Optional[int], log: Callable[[str], None]) -> dict:
    """Training steps with a validation check every eval_interval_s and one at the end, until the time budget,
    max_steps or the patience runs out (result.stop_reason says which); returns the best state by validation tau."""
    recipe, num_depths = result.recipe, result.cfg.num_depths
    weights = depth_weights(num_depths, recipe.gamma, device)
    gen = torch.Generator(device=device).manual_seed(seed)
    window = _Window(torch.zeros((), device=device), torch.zeros(num_depths, device=device))
    start = time.perf_counter()
    last_eval = start
    best_state, evals_since_best = None, 0
    while True:
        elapsed = time.perf_counter() - start
        progress = elapsed / time_budget
        if max_steps:
            progress = max(progress, result.steps / max_steps)
        out_of_time = elapsed >= time_budget or (max_steps is not None and result.steps >= max_steps)
        if result.steps > 0 and (out_of_time or time.perf_counter() - last_eval >= recipe.eval_interval_s):
            state = _validation_check(result, optimizer, sets, window, last_eval, log)
            if state is not None:
                best_state, evals_since_best = state, 0
            else:
                evals_since_best += 1
            last_eval = time.perf_counter()
            out_of_time = out_of_time or last_eval - start >= time_budget
        if out_of_time or evals_since_best >= recipe.patience:
            result.stop_reason = "max steps" if max_steps is not None and result.steps >= max_steps else \
                "time budget spent" if out_of_time else f"no better validation tau in {recipe.patience} checks"
            return best_state
        _train_step(result, optimizer, sets, weights, gen, window, progress, device)


def _validation_check(result: DrafterResult, optimizer, sets: _Sets, window: _Window, last_eval: float,
                      log: Callable[[str], None]) -> Optional[dict]:
    """One point of the loss curve, with the chain tau on the validation blocks; the window is reset. Returns a
    copy of the model's state when the tau is the best so far, else None."""
    t_eval = time.perf_counter()
    model = result.model
    tau = quick_tau(model, sets.val, sets.val_anchors, sets.val_valid, sets.embed, sets.lm_head)
    point = {"step": result.steps, "blocks": result.blocks, "seconds": result.train_seconds,
             "lr": optimizer.param_groups[0]["lr"], "train_loss": float(window.loss_sum) / window.steps,
             "ce_per_depth": [float(x) / window.steps for x in window.ce_sum], "validation_tau": tau}
    result.curve.append(point)
    best = tau > result.best_validation_tau
    state = None
    if best:
        result.best_validation_tau, result.best_step = tau, result.steps
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    log(f"step {result.steps:6d} | {window.blocks / max(time.perf_counter() - last_eval, 1e-9):9,.0f} "
        f"blocks/s | loss {point['train_loss']:.4f} | ce d1 {point['ce_per_depth'][0]:.3f} d{result.cfg.num_depths} "
        f"{point['ce_per_depth'][-1]:.3f} | lr {point['lr']:.2e} | validation tau {tau:.3f}"
        f"{' (best)' if best else ''}")
    window.reset()
    result.eval_seconds += time.perf_counter() - t_eval
    return state


def _sample_batch(sets: _Sets, recipe, num_depths: int, device: torch.device, gen: torch.Generator):
    """One training batch: S sequences with usable anchors, A anchors each -> (context, anchors, bonus, labels)."""
    S, A = recipe.batch_sequences, recipe.anchors_per_sequence
    seq = sets.usable[torch.randint(len(sets.usable), (S,), device=device, generator=gen)]
    anchors = sample_anchors(sets.train.anchor_ok, seq, A, gen)
    width = int(anchors.max())
    ctx = sets.train.hidden[seq, :width].float()
    bonus = sets.train.tokens[seq[:, None], anchors]
    return ctx, anchors, bonus, block_labels(sets.train.tokens, seq, anchors, num_depths)


def _train_step(result: DrafterResult, optimizer, sets: _Sets, weights: torch.Tensor, gen: torch.Generator,
                window: _Window, progress: float, device: torch.device) -> None:
    """One optimiser step at the scheduled learning rate; adds to the window and the result's counters."""
    t_step = time.perf_counter()
    recipe, model = result.recipe, result.model
    lr = learning_rate(recipe, result.steps, progress)
    for group in optimizer.param_groups:
        group["lr"] = lr
    ctx, anchors, bonus, labels = _sample_batch(sets, recipe, result.cfg.num_depths, device, gen)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        hidden = model(ctx, anchors, bonus, sets.embed)
        loss, ce = block_loss(hidden, labels, sets.lm_head, weights)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    blocks = recipe.batch_sequences * recipe.anchors_per_sequence
    window.loss_sum += loss.detach()
    window.ce_sum += ce
    window.steps += 1
    window.blocks += blocks
    result.steps += 1
    result.blocks += blocks
    _sync(device)
    result.train_seconds += time.perf_counter() - t_step


def _final_evaluation(result: DrafterResult, best_state: dict, sets: _Sets, data: PreparedData,
                      device: torch.device, log: Callable[[str], None]) -> None:
    """Restore the best state, round it to bf16, score it on the held-out blocks, fold the fitted temperature into
    norm.weight, round again and score it next to the bigram baselines (result.heldout)."""
    t_final = time.perf_counter()
    model, recipe = result.model, result.recipe
    model.load_state_dict(best_state)
    model.eval()
    round_to_bf16(model)
    torch.set_float32_matmul_precision("highest")
    with torch.no_grad():
        uncalibrated = _drafter_scores(model, sets.heldout, sets.ev_anchors, sets.ev_valid, sets.embed,
                                       sets.lm_head, recipe)
        temperature, calibration = fit_temperature(model, sets.val, sets.val_anchors, sets.val_valid, sets.embed,
                                                   sets.lm_head)
        model.norm.weight.div_(temperature)
        round_to_bf16(model)
        report = _final_scores(model, sets.train, sets.heldout, sets.ev_anchors, sets.ev_valid, sets.embed,
                               sets.lm_head, data, sets.embed.shape[0], recipe, device)
    report["drafter_before_temperature"] = uncalibrated
    report["temperature"] = {**calibration, "folded": "norm.weight divided by T before the bf16 rounding; "
                                                      "'drafter' is scored with it, 'drafter_before_temperature' "
                                                      "without (T = 1)"}
    result.heldout = report
    log(f"temperature {temperature:.3f} (validation cross-entropy {calibration['validation_nll_at_1']:.4f} at T=1, "
        f"{calibration['validation_nll_at_T']:.4f} at T), folded into norm.weight")
    for name in ("drafter_before_temperature", "drafter", "bigram_target_generated", "bigram_corpus"):
        log(format_summary(name, report[name]))
    result.final_eval_seconds = time.perf_counter() - t_final


def _log_run(result: DrafterResult, device: torch.device, log: Callable[[str], None]) -> None:
    log(f"{result.steps} steps, {result.blocks:,} blocks in {result.train_seconds:.1f} s "
        f"({result.blocks / max(result.train_seconds, 1e-9):,.0f} blocks/s); final evaluation "
        f"{result.final_eval_seconds:.1f} s; stop: {result.stop_reason}"
        + (f"; peak GPU memory {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB" if device.type == "cuda"
           else ""))


def _drafter_scores(model, heldout: GeneratedSet, anchors, valid, embed, lm_head, recipe) -> dict:
    scores = DraftScores(model.cfg.num_depths, recipe.tree_blocks)
    for lp, tg in drafter_chunks(model, heldout, anchors, valid, embed, lm_head, 8):
        scores.add(lp, tg)
    return scores.report()


def _final_scores(model, train: GeneratedSet, heldout: GeneratedSet, anchors, valid, embed, lm_head,
                  data: PreparedData, vocab: int, recipe, device) -> dict:
    L = model.cfg.num_depths
    pos = torch.arange(1, train.tokens.shape[1], device=device)[None, :]
    generated = (pos >= train.prompt_lengths[:, None]) & (pos < train.lengths[:, None])  # the pair's second token
    table_gen = bigram_table(train.tokens[:, :-1][generated], train.tokens[:, 1:][generated], vocab)
    stream = torch.from_numpy(data.train.astype(np.int64)).to(device)
    table_corpus = bigram_table(stream[:-1], stream[1:], vocab)
    out = {"evaluation": "held-out generated sequences, up to eval_anchors_per_sequence distinct usable anchors each "
                         "(seeded); bf16-rounded drafter weights, fp32 compute; baselines on the same blocks",
           "drafter": _drafter_scores(model, heldout, anchors, valid, embed, lm_head, recipe)}
    for name, table in (("bigram_target_generated", table_gen), ("bigram_corpus", table_corpus)):
        scores = DraftScores(L, min(recipe.tree_blocks, 1024))
        for lp, tg in bigram_chunks(table, heldout, anchors, valid, L):
            scores.add(lp, tg)
        out[name] = scores.report()
    out["baselines"] = {"bigram_target_generated": "bigram chain (depth j drafts from the rank-0 token of depth "
                                                   "j-1) counted on the pairs of the training sequences whose "
                                                   "second token the target generated",
                        "bigram_corpus": "the same, counted on the training token stream (the corpus)"}
    return out
