"""The training loop: transformers' DeepseekV3ForCausalLM on random windows of the training stream.

One step: a batch of random ``context``-token windows (they may cross file boundaries; EOD marks them), bf16
autocast forward, cross-entropy, backward, gradient clipping, AdamW, then the aux-loss-free bias update from
that step's routed counts (balance.py). Every ``eval_interval_s`` the whole held-out split is scored; the
state with the best held-out loss is kept (early stopping after ``patience`` evaluations without a better
one). The learning rate warms up linearly, then follows a cosine over the time budget (or ``max_steps``).
"""
from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F

from .balance import RouterLoads, load_spread
from .evaluate import HeldoutScore, autocast_context, heldout_score
from .recipe import ModelShape, OptimRecipe
from .tokenizer import EOD_ID
from .windows import EvalWindows


@dataclass
class TrainResult:
    model: torch.nn.Module              # fp32 module holding the best state, weights rounded to bf16
    loads: RouterLoads
    curve: list[dict] = field(default_factory=list)  # {step, tokens, seconds, lr, train_loss, heldout_loss, ...}
    best_step: int = 0
    best_heldout_loss: float = math.inf
    steps: int = 0
    tokens: int = 0
    train_seconds: float = 0.0          # optimizer steps only
    eval_seconds: float = 0.0
    stop_reason: str = ""
    final: Optional[HeldoutScore] = None  # the saved weights (bf16-rounded) scored in fp32
    parameters: int = 0


def build_model(shape: ModelShape, device: torch.device, seed: int, experts_implementation: Optional[str] = None):
    """A freshly initialised fp32 DeepseekV3ForCausalLM of ``shape`` on ``device``; ``experts_implementation``
    is transformers' (eager, grouped_mm, batched_mm; None: transformers picks)."""
    import transformers

    torch.manual_seed(seed)
    extra = {} if experts_implementation is None else {"experts_implementation": experts_implementation}
    config = transformers.DeepseekV3Config(**shape.hf_config_kwargs(EOD_ID), **extra)
    model = transformers.DeepseekV3ForCausalLM(config)
    return model.to(device=device, dtype=torch.float32)


def count_parameters(model) -> int:
    """Parameters plus the routers' e_score_correction_bias buffers: every tensor the checkpoint stores."""
    biases = sum(gate.e_score_correction_bias.numel() for gate in model.modules()
                 if hasattr(gate, "e_score_correction_bias"))
    return sum(p.numel() for p in model.parameters()) + biases


def learning_rate(optim: OptimRecipe, step: int, progress: float) -> float:
    """Linear warmup over ``warmup_steps``, then cosine from lr to min_lr_ratio * lr as progress goes 0 -> 1."""
    if step < optim.warmup_steps:
        return optim.lr * (step + 1) / optim.warmup_steps
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(max(progress, 0.0), 1.0)))
    return optim.lr * (optim.min_lr_ratio + (1.0 - optim.min_lr_ratio) * cosine)


def make_optimizer(model, optim: OptimRecipe, device: torch.device) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices (embeddings, projections, experts, router), none on norms."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": optim.weight_decay},
                              {"params": rest, "weight_decay": 0.0}],
                             lr=optim.lr, betas=(optim.beta1, optim.beta2), fused=device.type == "cuda")


def add_embedding_dropout(model, p: float):
    """Dropout on the embedding output while training (not part of the saved model)."""
    if p <= 0:
        return None
    return model.model.embed_tokens.register_forward_hook(
        lambda module, inputs, output: F.dropout(output, p=p, training=module.training))


def round_to_bf16(model) -> None:
    """Round every parameter to bf16 and back (what the bf16 checkpoint holds); the router biases stay fp32,
    as they are saved in fp32."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).to(p.dtype))


def bf16_copy(model):
    """A bf16 copy for saving, with the e_score_correction_bias buffers kept fp32 (as DeepSeek-V3 ships them)."""
    saved = copy.deepcopy(model).to(torch.bfloat16)
    for name, module in saved.named_modules():
        if hasattr(module, "e_score_correction_bias"):
            source = model.get_submodule(name).e_score_correction_bias
            module.e_score_correction_bias = source.detach().to(torch.float32).clone()
    return saved


@dataclass
class _Loop:
    """What the training loop carries from step to step: the model and its optimiser, the batch source, the
    train loss summed since the last evaluation, the best state so far and the result being filled in."""
    optim: OptimRecipe
    device: torch.device
    model: torch.nn.Module
    result: TrainResult
    dropout_hook: Optional[torch.utils.hooks.RemovableHandle]
    optimizer: torch.optim.AdamW
    stream: torch.Tensor                # the training tokens, on the device
    offsets: torch.Tensor               # 0 .. context: one window's positions
    generator: torch.Generator
    loss_sum: torch.Tensor
    loss_steps: int = 0
    best_state: Optional[dict] = None
    evals_since_best: int = 0


def _start(shape: ModelShape, optim: OptimRecipe, train_stream: np.ndarray, device: torch.device, seed: int,
           experts_implementation: Optional[str]) -> _Loop:
    """A fresh model (in train mode) with its optimiser and embedding dropout, and the seeded batch source."""
    model = build_model(shape, device, seed, experts_implementation)
    result = TrainResult(model=model, loads=RouterLoads(model), parameters=count_parameters(model))
    dropout_hook = add_embedding_dropout(model, optim.embedding_dropout)
    optimizer = make_optimizer(model, optim, device)
    stream = torch.from_numpy(train_stream.astype(np.int64)).to(device)
    offsets = torch.arange(optim.context + 1, device=device)
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    model.train()
    return _Loop(optim=optim, device=device, model=model, result=result, dropout_hook=dropout_hook,
                 optimizer=optimizer, stream=stream, offsets=offsets, generator=generator,
                 loss_sum=torch.zeros((), device=device))


def _step(loop: _Loop, progress: float) -> None:
    """One optimiser step on a batch of random windows, then the routers' bias update from its counts."""
    optim, model, result = loop.optim, loop.model, loop.result
    t_step = time.perf_counter()
    lr = learning_rate(optim, result.steps, progress)
    for group in loop.optimizer.param_groups:
        group["lr"] = lr
    starts = torch.randint(0, len(loop.stream) - optim.context - 1, (optim.batch_size,), device=loop.device,
                           generator=loop.generator)
    batch = loop.stream[starts[:, None] + loop.offsets]  # [b, context + 1]
    x, y = batch[:, :-1], batch[:, 1:]
    with autocast_context(loop.device, optim.autocast_bf16):
        logits = model(input_ids=x, use_cache=False).logits
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), optim.grad_clip)
    loop.optimizer.step()
    loop.optimizer.zero_grad(set_to_none=True)
    result.loads.update_biases(result.loads.take(), optim.bias_update_rate)
    loop.loss_sum += loss.detach()
    loop.loss_steps += 1
    result.steps += 1
    result.tokens += optim.batch_size * optim.context
    if loop.device.type == "cuda":
        torch.cuda.synchronize()  # honest step time for tokens/s (HF's MoE syncs every layer anyway)
    result.train_seconds += time.perf_counter() - t_step


def _evaluate(loop: _Loop, windows: EvalWindows, heldout_bytes: int, elapsed: float,
              log: Callable[[str], None]) -> None:
    """Score the held-out split, keep the state if it is the best yet, add a curve point and log it."""
    optim, model, result = loop.optim, loop.model, loop.result
    t_eval = time.perf_counter()
    # With the loads passed, the hooks' held-out choices are taken here, not by the next step's update.
    score = heldout_score(model, windows, optim.eval_batch_size, loop.device, optim.autocast_bf16,
                          loads=result.loads)
    expert_cv = load_spread(score.expert_counts)["cv_mean"]
    result.eval_seconds += time.perf_counter() - t_eval
    train_loss = (loop.loss_sum / max(loop.loss_steps, 1)).item()
    loop.loss_sum.zero_()
    loop.loss_steps = 0
    improved = score.loss < result.best_heldout_loss
    if improved:
        result.best_heldout_loss, result.best_step, loop.evals_since_best = score.loss, result.steps, 0
        loop.best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    else:
        loop.evals_since_best += 1
    lr = loop.optimizer.param_groups[0]["lr"]
    result.curve.append({"step": result.steps, "tokens": result.tokens, "seconds": round(elapsed, 2),
                         "lr": lr, "train_loss": train_loss, "heldout_loss": score.loss,
                         "heldout_expert_cv": expert_cv})
    tok_s = result.tokens / max(result.train_seconds, 1e-9)
    log(f"step {result.steps:6d}  tokens {result.tokens:11d}  {tok_s:10.0f} tok/s  lr {lr:.2e}  "
        f"train {train_loss:.4f}  held-out {score.loss:.4f} ({score.bits_per_byte(heldout_bytes):.4f} "
        f"bits/byte)  expert cv {expert_cv:.3f}{'  *best' if improved else ''}")


def _stop_reason(loop: _Loop, out_of_time: bool, max_steps: Optional[int]) -> str:
    """Why training stops after this evaluation ("" to go on): patience spent, max_steps or the time budget."""
    if loop.evals_since_best >= loop.optim.patience:
        return f"early stop: {loop.optim.patience} evaluations without a better held-out loss"
    if out_of_time:
        return "max_steps reached" if max_steps is not None and loop.result.steps >= max_steps \
            else "time budget spent"
    return ""


def _finish(loop: _Loop, windows: EvalWindows, heldout_bytes: int, log: Callable[[str], None]) -> None:
    """Drop the dropout, load the best state rounded to bf16 and score it in full fp32."""
    result = loop.result
    if loop.dropout_hook is not None:
        loop.dropout_hook.remove()
    loop.model.load_state_dict(loop.best_state)
    round_to_bf16(loop.model)
    torch.set_float32_matmul_precision("highest")
    result.final = heldout_score(loop.model, windows, loop.optim.eval_batch_size, loop.device, autocast=False,
                                 loads=result.loads)
    log(f"best step {result.best_step}: held-out {result.final.loss:.4f} nats/token, "
        f"{result.final.bits_per_byte(heldout_bytes):.4f} bits/byte (bf16 weights, fp32 compute); "
        f"expert load spread {load_spread(result.final.expert_counts)['max_over_min_worst']}")


def train(shape: ModelShape, optim: OptimRecipe, train_stream: np.ndarray, windows: EvalWindows,
          heldout_bytes: int, device: torch.device, time_budget: float, seed: int,
          max_steps: Optional[int] = None, experts_implementation: Optional[str] = None,
          log: Callable[[str], None] = print) -> TrainResult:
    """Train until the time budget (seconds of steps and evaluations), ``max_steps`` or early stopping."""
    if len(train_stream) <= optim.context + 1:
        raise ValueError(f"training stream of {len(train_stream)} tokens is not longer than a window")
    torch.set_float32_matmul_precision("high")  # TF32 for training speed; the final score is full fp32
    loop = _start(shape, optim, train_stream, device, seed, experts_implementation)
    result = loop.result
    start = time.perf_counter()
    last_eval = start
    while True:
        elapsed = time.perf_counter() - start
        progress = elapsed / time_budget if time_budget > 0 else 1.0
        if max_steps:
            progress = max(progress, result.steps / max_steps)
        out_of_time = elapsed >= time_budget or (max_steps is not None and result.steps >= max_steps)
        if result.steps > 0 and (out_of_time or time.perf_counter() - last_eval >= optim.eval_interval_s):
            _evaluate(loop, windows, heldout_bytes, elapsed, log)
            last_eval = time.perf_counter()
            result.stop_reason = _stop_reason(loop, out_of_time, max_steps)
            if result.stop_reason:
                break
        _step(loop, progress)
    _finish(loop, windows, heldout_bytes, log)
    return result
