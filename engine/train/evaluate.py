"""Held-out cross-entropy of the model over every held-out token (windows.py), and bits per byte.

bits/byte = total held-out cross-entropy in nats / ln 2 / held-out raw UTF-8 bytes.
"""
from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from .balance import RouterLoads
from .windows import IGNORE, EvalWindows


@dataclass(frozen=True)
class HeldoutScore:
    nats: float          # summed cross-entropy over every prediction
    predictions: int     # tokens predicted (every token of every file plus each file's closing EOD)
    expert_counts: Optional[torch.Tensor]  # [moe layers, e] routed choices of the real (unpadded) positions

    @property
    def loss(self) -> float:
        """Mean cross-entropy per token, nats."""
        return self.nats / self.predictions

    def bits_per_byte(self, raw_bytes: int) -> float:
        return self.nats / math.log(2) / raw_bytes


def autocast_context(device: torch.device, enabled: bool):
    return torch.autocast(device.type, dtype=torch.bfloat16) if enabled else nullcontext()


@torch.no_grad()
def heldout_score(model, windows: EvalWindows, batch_size: int, device: torch.device, autocast: bool,
                  loads: Optional[RouterLoads] = None) -> HeldoutScore:
    """Sum of cross-entropy over all windows, in eval mode (no dropout); the model's mode is restored."""
    was_training = model.training
    model.eval()
    if loads is not None:
        loads.discard()
    nats = torch.zeros((), dtype=torch.float64, device=device)
    counts = None
    try:
        for x, y in windows.batches(batch_size):
            x = torch.from_numpy(x).to(device)
            y = torch.from_numpy(y).to(device)
            with autocast_context(device, autocast):
                logits = model(input_ids=x, use_cache=False).logits
            nats += F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1),
                                    ignore_index=IGNORE, reduction="sum").double()
            if loads is not None:
                batch_counts = loads.take(valid=(y != IGNORE))
                counts = batch_counts if counts is None else counts + batch_counts
    finally:
        model.train(was_training)
    return HeldoutScore(float(nats.item()), windows.predictions, None if counts is None else counts.cpu())
