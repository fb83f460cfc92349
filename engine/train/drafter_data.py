"""The drafter's training data: the frozen target's own greedy continuations and its hidden states.

1. Prompts: random windows of a split's token stream (they may start mid-file and cross EODs), one length per
   generation batch drawn uniformly from [prompt_min, prompt_max], start positions uniform.
2. Continuations: the target greedily extends each prompt by ``new_tokens`` tokens with its KV cache (bf16
   autocast for speed; EOD does not stop it, the target simply goes on).
3. Labels: one fp32 forward of the target over each whole sequence (prompt + continuation, no autocast,
   full-precision matmuls) gives the tapped hidden states and the argmax at every row. Row t is "greedy" when
   its token equals the fp32 argmax of row t - 1. Generation in bf16 can pick another token at a near-tie; an
   anchor P is used only when rows P .. P + L are all greedy, so every block's bonus and labels are exactly the
   fp32 target's greedy chain from the context (the context itself is whatever was generated).
4. Anchors: P in [prompt length, sequence length - 1 - L] with that condition; context rows t < P.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch


@dataclass
class GeneratedSet:
    """N sequences padded to a common width W (rows past ``lengths`` are padding, never visible).

    tokens [N, W] int64; lengths, prompt_lengths [N] int64; hidden [N, W, n*d] (the tapped target layers,
    float32 or bfloat16); greedy [N, W] bool (module docstring); anchor_ok [N, W] bool: usable anchors.
    """

    tokens: torch.Tensor
    lengths: torch.Tensor
    prompt_lengths: torch.Tensor
    hidden: torch.Tensor
    greedy: torch.Tensor
    anchor_ok: torch.Tensor
    generate_seconds: float = 0.0   # of all sets built together
    forward_seconds: float = 0.0

    @property
    def sequences(self) -> int:
        return int(self.tokens.shape[0])

    def rows(self, start: int, stop: Optional[int] = None) -> "GeneratedSet":
        """Sequences start..stop-1 (views)."""
        sl = slice(start, stop)
        return GeneratedSet(self.tokens[sl], self.lengths[sl], self.prompt_lengths[sl], self.hidden[sl],
                            self.greedy[sl], self.anchor_ok[sl], self.generate_seconds, self.forward_seconds)

    def summary(self) -> dict:
        gen = torch.arange(self.tokens.shape[1], device=self.tokens.device)[None, :]
        generated = (gen >= self.prompt_lengths[:, None]) & (gen < self.lengths[:, None])
        return {"sequences": self.sequences, "tokens": int(self.lengths.sum()),
                "generated_tokens": int(generated.sum()),
                "generated_not_fp32_greedy": int((generated & ~self.greedy).sum()),
                "usable_anchors": int(self.anchor_ok.sum()),
                "prompt_lengths": sorted({int(x) for x in self.prompt_lengths.tolist()}),
                "generate_seconds": self.generate_seconds, "forward_seconds": self.forward_seconds}


def prompt_windows(stream: np.ndarray, count: int, length: int, rng: np.random.Generator) -> np.ndarray:
    """``count`` random windows [count, length] int64 of the stream."""
    if len(stream) <= length:
        raise ValueError(f"stream of {len(stream)} tokens is too short for {length}-token prompts")
    starts = rng.integers(0, len(stream) - length, size=count)
    return stream[starts[:, None] + np.arange(length)].astype(np.int64)


@torch.no_grad()
def greedy_generate(model, prompts: torch.Tensor, new_tokens: int, autocast: bool) -> torch.Tensor:
    """prompts [B, l] -> [B, l + new_tokens]: the target's argmax continuation, with its KV cache."""
    from transformers import DynamicCache

    ctx = torch.autocast(prompts.device.type, dtype=torch.bfloat16) if autocast else torch.autocast(
        prompts.device.type, enabled=False)
    out = torch.empty(prompts.shape[0], prompts.shape[1] + new_tokens, dtype=torch.long, device=prompts.device)
    out[:, :prompts.shape[1]] = prompts
    cache = DynamicCache(config=model.config)
    step_input = prompts
    with ctx:
        for i in range(new_tokens):
            logits = model(input_ids=step_input, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
            step_input = logits[:, -1].float().argmax(-1, keepdim=True)
            out[:, prompts.shape[1] + i] = step_input[:, 0]
    return out


class LayerTaps:
    """Forward hooks keeping the residual stream after decoder layer i - 1 (i = 0: the embedding output) for
    each i in ``layers`` (engine/model/drafter.py: not the final-normed state)."""

    def __init__(self, model, layers: tuple[int, ...]):
        self.layers = layers
        self.outputs: dict[int, torch.Tensor] = {}
        base = model.model
        self.handles = []
        for i in layers:
            module = base.embed_tokens if i == 0 else base.layers[i - 1]
            self.handles.append(module.register_forward_hook(self._hook(i)))

    def _hook(self, i: int):
        def keep(module, inputs, output):
            self.outputs[i] = output[0] if isinstance(output, tuple) else output
        return keep

    def take(self) -> torch.Tensor:
        """[B, T, n*d]: the taps concatenated in ``layers`` order."""
        out = torch.cat([self.outputs[i] for i in self.layers], dim=-1)
        self.outputs.clear()
        return out

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


@torch.no_grad()
def teacher_forced(model, tokens: torch.Tensor, layers: tuple[int, ...], batch: int,
                   store_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 forward over whole sequences: (hidden [B, T, n*d] in store_dtype, argmax [B, T] int64)."""
    taps = LayerTaps(model, layers)
    hidden, argmax = [], []
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        for start in range(0, tokens.shape[0], batch):
            x = tokens[start:start + batch]
            last = model.model(input_ids=x, use_cache=False).last_hidden_state
            hidden.append(taps.take().to(store_dtype))
            argmax.append(torch.cat([model.lm_head(last[:, i:i + 128]).argmax(-1)
                                     for i in range(0, x.shape[1], 128)], dim=1))
    finally:
        torch.set_float32_matmul_precision(previous)
        taps.remove()
    return torch.cat(hidden), torch.cat(argmax)


@dataclass
class _Part:
    tokens: torch.Tensor   # [b, t]
    hidden: torch.Tensor   # [b, t, n*d]
    argmax: torch.Tensor   # [b, t]
    prompt_length: int


def build_sets(model, train_stream: np.ndarray, heldout_stream: np.ndarray, train_sequences: int,
               heldout_sequences: int, new_tokens: int, prompt_min: int, prompt_max: int, gen_batch: int,
               depths: int, layers: tuple[int, ...], seed: int, device: torch.device, autocast: bool = True,
               forward_batch: int = 128, store_dtype: torch.dtype = torch.float32,
               time_budget: Optional[float] = None,
               log: Callable[[str], None] = print) -> tuple[GeneratedSet, GeneratedSet]:
    """(train, held-out) sets. The sequences are generated in about equal batches of at most ``gen_batch``
    (one prompt length per batch: the target's step costs about the same at any batch size, so batches are
    big); the first batch also carries every held-out prompt (drawn from the held-out stream with their own
    generator). With a ``time_budget`` (seconds) no new batch starts once it is spent."""
    rng_train, rng_heldout = np.random.default_rng(seed), np.random.default_rng(seed + 1)
    total = train_sequences + heldout_sequences
    batches = -(-total // gen_batch)
    size = -(-total // batches)
    train_parts, heldout_parts = [], []
    t_gen = t_fwd = 0.0
    t_start = time.perf_counter()
    done_train = index = 0
    while done_train < train_sequences:
        if index and time_budget is not None and time.perf_counter() - t_start >= time_budget:
            log(f"data: time budget {time_budget:.0f} s spent, stopping at {done_train} training sequences")
            break
        length = int(rng_train.integers(prompt_min, prompt_max + 1))
        held = heldout_sequences if index == 0 else 0
        count = min(max(size - held, 1), train_sequences - done_train)
        prompts = [prompt_windows(heldout_stream, held, length, rng_heldout)] if held else []
        prompts.append(prompt_windows(train_stream, count, length, rng_train))
        prompts = torch.from_numpy(np.concatenate(prompts)).to(device)
        t0 = time.perf_counter()
        seqs = greedy_generate(model, prompts, new_tokens, autocast)
        _sync(device)
        t1 = time.perf_counter()
        hidden, argmax = teacher_forced(model, seqs, layers, forward_batch, store_dtype)
        _sync(device)
        t2 = time.perf_counter()
        t_gen, t_fwd = t_gen + t1 - t0, t_fwd + t2 - t1
        if held:
            heldout_parts.append(_Part(seqs[:held], hidden[:held], argmax[:held], length))
        train_parts.append(_Part(seqs[held:], hidden[held:], argmax[held:], length))
        del seqs, hidden, argmax
        done_train += count
        index += 1
        log(f"data batch {index}/{batches}: {held} held-out + {count} training prompts of {length} tokens + "
            f"{new_tokens} generated: generate {t1 - t0:.1f} s ({len(prompts) * new_tokens / max(t1 - t0, 1e-9):,.0f}"
            f" tok/s), fp32 forward {t2 - t1:.1f} s")
    width = prompt_max + new_tokens
    sets = []
    for parts in (train_parts, heldout_parts):
        sets.append(_assemble(parts, width, depths, store_dtype, device))
        parts.clear()
    for gen in sets:
        gen.generate_seconds, gen.forward_seconds = t_gen, t_fwd
    return sets[0], sets[1]


def _assemble(parts: list[_Part], width: int, depths: int, store_dtype: torch.dtype,
              device: torch.device) -> GeneratedSet:
    n = sum(p.tokens.shape[0] for p in parts)
    d_in = parts[0].hidden.shape[-1]
    tokens = torch.zeros(n, width, dtype=torch.long, device=device)
    hidden = torch.zeros(n, width, d_in, dtype=store_dtype, device=device)
    greedy = torch.zeros(n, width, dtype=torch.bool, device=device)
    lengths = torch.zeros(n, dtype=torch.long, device=device)
    prompt_lengths = torch.zeros(n, dtype=torch.long, device=device)
    row = 0
    for part in parts:
        b, t = part.tokens.shape
        tokens[row:row + b, :t] = part.tokens
        hidden[row:row + b, :t] = part.hidden
        greedy[row:row + b, 1:t] = part.tokens[:, 1:] == part.argmax[:, :-1]
        lengths[row:row + b] = t
        prompt_lengths[row:row + b] = part.prompt_length
        row += b
    anchor_ok = usable_anchors(greedy, lengths, prompt_lengths, depths)
    return GeneratedSet(tokens, lengths, prompt_lengths, hidden, greedy, anchor_ok)


def usable_anchors(greedy: torch.Tensor, lengths: torch.Tensor, prompt_lengths: torch.Tensor,
                   depths: int) -> torch.Tensor:
    """anchor_ok [N, W]: prompt_length <= P <= length - 1 - L and rows P .. P + L all greedy."""
    width = greedy.shape[1]
    pos = torch.arange(width, device=greedy.device)[None, :]
    ok = (pos >= prompt_lengths[:, None]) & (pos <= lengths[:, None] - 1 - depths)
    window = greedy.clone()
    for j in range(1, depths + 1):
        window[:, :width - j] &= greedy[:, j:]
        window[:, width - j:] = False
    return ok & window


def sample_anchors(anchor_ok: torch.Tensor, seq_idx: torch.Tensor, per_sequence: int,
                   generator: torch.Generator) -> torch.Tensor:
    """[S, A] anchors drawn uniformly (with replacement) from each chosen sequence's usable anchors."""
    weights = anchor_ok[seq_idx].float()
    return torch.multinomial(weights, per_sequence, replacement=True, generator=generator)


def block_labels(tokens: torch.Tensor, seq_idx: torch.Tensor, anchors: torch.Tensor, depths: int) -> torch.Tensor:
    """tokens at P + 1 .. P + L for each block: [..., L]."""
    pos = anchors[..., None] + torch.arange(1, depths + 1, device=anchors.device)
    return tokens[seq_idx.reshape(seq_idx.shape + (1,) * (pos.dim() - seq_idx.dim())), pos]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
