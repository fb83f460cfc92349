"""DeepSeek-V3's auxiliary-loss-free expert balancing, and the expert load it is judged by.

transformers' ``DeepseekV3TopkRouter`` (``model.layers[i].mlp.gate``) returns (router_logits, topk_weights,
topk_indices [N, k]) and adds its ``e_score_correction_bias`` buffer [e] to the sigmoid scores for expert
choice only. A forward hook on each router records topk_indices; after every optimizer step the bias moves by
``rate * sign(mean_load - load_i)`` (DeepSeek-V3 report, eq. 16-17: an overloaded expert gets chosen less).
The bias is a persistent buffer, so it is in the state dict and the checkpoint.
"""
from __future__ import annotations

from typing import Optional

import torch


def moe_routers(model) -> list[tuple[int, torch.nn.Module]]:
    """(layer index, router) of every MoE layer, in layer order."""
    routers = []
    for i, layer in enumerate(model.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None and hasattr(gate, "e_score_correction_bias"):
            routers.append((i, gate))
    return routers


class RouterLoads:
    """Per-layer expert choices recorded by forward hooks; ``take`` turns them into counts [layers, e]."""

    def __init__(self, model):
        self.routers = moe_routers(model)
        if not self.routers:
            raise ValueError("model has no MoE router with an e_score_correction_bias")
        self.num_experts = int(self.routers[0][1].e_score_correction_bias.numel())
        self._choices: list[list[torch.Tensor]] = [[] for _ in self.routers]
        self._handles = [gate.register_forward_hook(self._hook(j)) for j, (_, gate) in enumerate(self.routers)]

    def _hook(self, j: int):
        def record(module, inputs, output):
            self._choices[j].append(output[2].detach())  # topk_indices [N, k]
        return record

    def take(self, valid: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Counts [layers, e] (int64) of the choices since the last take; ``valid`` [N] bool keeps rows (the
        flattened batch positions of one forward) and must match every recorded forward's N."""
        counts = []
        for choices in self._choices:
            total = torch.zeros(self.num_experts, dtype=torch.int64, device=self.device)
            for idx in choices:
                if valid is not None:
                    idx = idx[valid.reshape(-1)]
                flat = idx.reshape(-1)
                total.scatter_add_(0, flat, torch.ones_like(flat))  # bincount would sync with the host
            counts.append(total)
        self._choices = [[] for _ in self.routers]
        return torch.stack(counts)

    def discard(self) -> None:
        self._choices = [[] for _ in self.routers]

    @property
    def device(self) -> torch.device:
        return self.routers[0][1].e_score_correction_bias.device

    def remove(self) -> None:
        for h in self._handles:
            h.remove()

    @torch.no_grad()
    def update_biases(self, counts: torch.Tensor, rate: float) -> None:
        """bias_i += rate * sign(mean load - load_i), per layer, from counts [layers, e]."""
        for (_, gate), load in zip(self.routers, counts):
            load = load.to(torch.float32)
            bias = gate.e_score_correction_bias
            bias += (rate * torch.sign(load.mean() - load)).to(bias.dtype)

    def biases(self) -> list[list[float]]:
        return [gate.e_score_correction_bias.detach().float().cpu().tolist() for _, gate in self.routers]


def load_spread(counts: torch.Tensor) -> dict:
    """Per MoE layer and overall: max/min load ratio and coefficient of variation (std/mean) of counts."""
    counts = counts.to(torch.float64).cpu()
    per_layer = []
    for row in counts:
        mean = row.mean().item()
        per_layer.append({"counts": [int(x) for x in row.tolist()],
                          "max_over_min": (row.max() / row.min()).item() if row.min() > 0 else None,
                          "cv": (row.std(unbiased=False) / mean).item() if mean > 0 else 0.0})
    ratios = [p["max_over_min"] for p in per_layer]
    return {"per_layer": per_layer,
            "max_over_min_worst": None if None in ratios else max(ratios),  # None: some expert got no token
            "cv_mean": sum(p["cv"] for p in per_layer) / len(per_layer)}
