"""Held-out measurement of a drafter, and the bigram baselines measured beside it.

A drafter is scored on blocks (sequence, anchor P) of held-out generated sequences; the target's token at depth
j is the sequence's token at P + j (the fp32 greedy chain, drafter_data.py). Per block and depth the drafter
gives log-probs over the vocabulary. Reported:
- chain acceptance per depth: P(rank-0 is right at depths 1..j), and tau = 1 + leading right depths (mean),
  the tau of a greedy chain of budget L (the bonus counts, as in docs/ddtree.md);
- top-1 per depth without the chain condition, and where the target's token ranks (share within top 1, 8, 16,
  64) per depth;
- reliability: stated probability of every top-8 entry (rank 0 separately) in bins vs the measured share of
  entries equal to the target's token (marginal per depth: not conditioned on earlier depths);
- an estimate of DDTree's tau per tree budget: the best-first build of docs/ddtree.md over the drafter's
  per-depth top-K (scores summed in float64 here), tau = 1 + the depth of the deepest node on the target's path.
"""
from __future__ import annotations

import heapq
from typing import Callable

import numpy as np
import torch

RANK_KS = (1, 8, 16, 64)
BINS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
TREE_BUDGETS = (8, 16, 32, 64, 128, 256)
RELIABILITY_TOPK = 8


class DraftScores:
    """Accumulates chunks of (log-probs [n, L, V], targets [n, L]) and reports the module docstring's metrics."""

    def __init__(self, depths: int, tree_blocks: int = 2048, tree_topk: int = max(TREE_BUDGETS)):
        self.depths = depths
        self.tree_blocks, self.tree_topk = tree_blocks, tree_topk
        self.ranks: list[torch.Tensor] = []
        self.stated: list[torch.Tensor] = []   # [n, L, 8] probabilities of the top-8
        self.hits: list[torch.Tensor] = []     # [n, L, 8] bool
        self.tree_lp: list[np.ndarray] = []
        self.tree_ranks: list[np.ndarray] = []
        self._tree_taken = 0

    @torch.no_grad()
    def add(self, logprobs: torch.Tensor, targets: torch.Tensor) -> None:
        logprobs = logprobs.float()
        target_lp = logprobs.gather(-1, targets[..., None])
        ids = torch.arange(logprobs.shape[-1], device=logprobs.device)
        # rank in the order (log-prob descending, id ascending): rank 0 is exactly argmax (first maximum)
        rank = ((logprobs > target_lp) | ((logprobs == target_lp) & (ids < targets[..., None]))).sum(-1)
        k = min(max(RELIABILITY_TOPK, self.tree_topk), logprobs.shape[-1])
        top_lp, top_ids = logprobs.topk(k, dim=-1)
        self.ranks.append(rank.cpu())
        self.stated.append(top_lp[..., :RELIABILITY_TOPK].exp().cpu())
        self.hits.append((top_ids[..., :RELIABILITY_TOPK] == targets[..., None]).cpu())
        room = self.tree_blocks - self._tree_taken
        if room > 0:
            take = min(room, logprobs.shape[0])
            trank = rank[:take].clamp(max=k)  # tied log-probs are equal, so the tree sees the same scores
            self.tree_lp.append(top_lp[:take].double().cpu().numpy())
            self.tree_ranks.append(trank.cpu().numpy())
            self._tree_taken += take

    def report(self) -> dict:
        ranks = torch.cat(self.ranks)
        n = ranks.shape[0]
        right = ranks == 0
        chain = torch.cumprod(right.int(), dim=1).bool()
        out = {"blocks": n,
               "tau_chain": 1.0 + float(chain.float().sum(1).mean()),
               "chain_acceptance_per_depth": [float(x) for x in chain.float().mean(0)],
               "top1_per_depth": [float(x) for x in right.float().mean(0)],
               "rank_share_per_depth": {f"top{k}": [float(x) for x in (ranks < k).float().mean(0)]
                                        for k in RANK_KS},
               "reliability_top8": reliability(torch.cat(self.stated), torch.cat(self.hits)),
               "reliability_rank0": reliability(torch.cat(self.stated)[..., :1], torch.cat(self.hits)[..., :1])}
        if self.tree_lp:
            lp, tr = np.concatenate(self.tree_lp), np.concatenate(self.tree_ranks)
            out["tree_tau_estimate"] = {"blocks": int(lp.shape[0]), "topk_per_depth": int(lp.shape[-1]),
                                        **{str(b): v for b, v in tree_tau(lp, tr, TREE_BUDGETS).items()}}
        return out


def reliability(stated: torch.Tensor, hits: torch.Tensor) -> list[dict]:
    """Bins of stated probability: [{"lo", "hi", "entries", "mean_stated", "measured"}] (empty bins left out)."""
    p, h = stated.flatten().double(), hits.flatten().double()
    rows = []
    for lo, hi in zip(BINS[:-1], BINS[1:]):
        sel = (p >= lo) & ((p < hi) if hi < 1.0 else (p <= hi))
        count = int(sel.sum())
        if count:
            rows.append({"lo": lo, "hi": hi, "entries": count, "mean_stated": float(p[sel].mean()),
                         "measured": float(h[sel].mean())})
    return rows


def tree_tau(lp: np.ndarray, target_ranks: np.ndarray, budgets) -> dict[int, float]:
    """Mean tau of the best-first tree of each budget. lp [n, L, K] sorted descending per depth; target_ranks
    [n, L] (K: not in the top-K). Node order = pop order (docs/ddtree.md), ties broken by the rank tuple."""
    n, L, K = lp.shape
    biggest = max(budgets)
    taus = {b: 0.0 for b in budgets}
    for i in range(n):
        path = tuple(int(r) for r in target_ranks[i])
        # depth_found[j]: pop index (1-based node index) of the target's depth-(j+1) prefix, or a big number
        found = [biggest + 1] * L
        heap = [(-lp[i, 0, 0], (0,), 0.0)]
        popped = 0
        while heap and popped < biggest:
            neg, ranks, parent = heapq.heappop(heap)
            popped += 1
            d = len(ranks)
            if ranks == path[:d]:
                found[d - 1] = popped
            if ranks[-1] + 1 < K:
                heapq.heappush(heap, (-(parent + lp[i, d - 1, ranks[-1] + 1]), ranks[:-1] + (ranks[-1] + 1,),
                                      parent))
            if d < L:
                heapq.heappush(heap, (-(-neg + lp[i, d, 0]), ranks + (0,), -neg))
        for b in budgets:
            depth = 0
            while depth < L and found[depth] <= b:
                depth += 1
            taus[b] += 1 + depth
    return {b: t / n for b, t in taus.items()}


@torch.no_grad()
def score_drafter(logprob_chunks: Callable, depths: int, tree_blocks: int = 2048) -> dict:
    """Run a drafter's chunks [(logprobs [n, L, V], targets [n, L])] through DraftScores."""
    scores = DraftScores(depths, tree_blocks)
    for logprobs, targets in logprob_chunks():
        scores.add(logprobs, targets)
    return scores.report()


def bigram_table(current: torch.Tensor, following: torch.Tensor, vocab: int, smoothing: float = 0.01) -> torch.Tensor:
    """log P(next | current) [V, V] float32 from token pairs (current[i], following[i]), add-smoothed."""
    counts = torch.bincount(current.long() * vocab + following.long(), minlength=vocab * vocab).double()
    counts = counts.view(vocab, vocab) + smoothing
    return (counts / counts.sum(1, keepdim=True)).log().float()


def bigram_chain_logprobs(table: torch.Tensor, bonus: torch.Tensor, depths: int) -> torch.Tensor:
    """A bigram chain drafter: depth 1 = table[bonus], depth j = table[rank-0 token of depth j-1]; [n, L, V]."""
    out, current = [], bonus
    for _ in range(depths):
        row = table[current]
        out.append(row)
        current = row.argmax(-1)
    return torch.stack(out, dim=1)


def format_summary(name: str, report: dict) -> str:
    per_depth = " ".join(f"{x:.3f}" for x in report["chain_acceptance_per_depth"])
    tree = report.get("tree_tau_estimate", {})
    trees = " ".join(f"B{b}={tree[str(b)]:.2f}" for b in TREE_BUDGETS if str(b) in tree)
    return (f"{name}: tau(chain) {report['tau_chain']:.3f}; chain acceptance by depth {per_depth}; top-8 by depth "
            f"{' '.join(f'{x:.2f}' for x in report['rank_share_per_depth']['top8'])}; tree tau {trees}")
