"""DeviceTreeOps: token choice, tree build and accept of a DDTree step on the device kernels."""
from __future__ import annotations

import numpy as np
from numba import cuda

from kdspec.engine.device.logits import DeviceLogits
from kdspec.engine.golden import ddtree as ddtree_ref
from kdspec.numba_kernels import sampling
from kdspec.numba_kernels.tree import accept as tree_accept
from kdspec.numba_kernels.tree import build as tree_build
from kdspec.traces.schema import TARGET_TOPK


class DeviceTreeOps:
    """Token choice, tree build and accept on the device kernels (one request per launch here)."""

    @staticmethod
    def choose_tokens(logits, temperature: float, seed: int, positions: np.ndarray) -> np.ndarray:
        """logits: DeviceLogits (chosen where they are) or a host array [s, V] (uploaded)."""
        kept = logits if isinstance(logits, DeviceLogits) else None
        logits = (logits.device if kept is not None
                  else cuda.to_device(np.ascontiguousarray(logits, dtype=np.float32)))
        if temperature == 0 and kept is not None and logits.shape[1] >= TARGET_TOPK:
            # Greedy choice = the first of the top-k (same tie rule); the step record then reuses the top-k
            # instead of another pass over the vocabulary.
            top_ids, top_values, margins = sampling.topk_rows(logits, TARGET_TOPK)
            host_ids = top_ids.copy_to_host()
            kept._topk = (TARGET_TOPK, host_ids, top_values, margins)  # ids already here: one copy fewer
            ids = host_ids[:, 0]
        elif temperature == 0:
            ids = sampling.argmax_rows(logits)
        else:
            ids = sampling.sample_rows(logits, float(temperature), int(seed), np.asarray(positions, dtype=np.int64))
        ids = ids.copy_to_host() if hasattr(ids, "copy_to_host") else np.asarray(ids)
        return ids.astype(np.int64)

    @staticmethod
    def build_tree(draft_logprobs, draft_ids, root_token: int, budget: int, prefix_len: int) -> ddtree_ref.Tree:
        ddtree_ref.check_draft(draft_logprobs, draft_ids, budget)
        batch = tree_build.build_trees(np.ascontiguousarray(draft_logprobs[None], dtype=np.float32),
                                       np.ascontiguousarray(draft_ids[None], dtype=np.int32),
                                       np.array([root_token], np.int32), np.array([prefix_len], np.int32), budget)
        built = {name: values[0] for name, values in batch.to_host().items()}  # three device reads in all
        count = int(built["num_nodes"])
        bits = built["visibility"][:count]  # [N+1, W] uint32, bit j of row i: j is an ancestor-or-self of i
        visibility = ((bits[:, :, None] >> np.arange(32, dtype=np.uint32)) & 1).reshape(count, -1)[:, :count]
        return ddtree_ref.Tree(tokens=built["tokens"][:count].astype(np.int64), parents=built["parents"][:count],
                               depths=built["depths"][:count], ranks=built["ranks"][:count],
                               scores=built["scores"][:count], positions=built["positions"][:count].astype(np.int64),
                               visibility=visibility.astype(bool))

    @staticmethod
    def accept(parents, tokens, target_choice) -> tuple[np.ndarray, int]:
        count = len(parents)
        depth_limit = count  # a path has at most num_nodes nodes
        accepted, tau, bonus = tree_accept.accept_trees(np.asarray(parents, np.int32)[None],
                                                        np.asarray(tokens, np.int32)[None],
                                                        np.asarray(target_choice, np.int32)[None],
                                                        np.array([count], np.int32), depth_limit)
        host = lambda a: a.copy_to_host() if hasattr(a, "copy_to_host") else np.asarray(a)  # noqa: E731
        tau = int(host(tau)[0])
        return host(accepted)[0, :tau].astype(np.int32), int(host(bonus)[0])
