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
        """The tree on the host for accept and the record; its visibility is the build kernel's packed bitmask
        uint32 [N+1, W] left on the device, which the verify forward hands to attention as it is."""
        ddtree_ref.check_draft(draft_logprobs, draft_ids, budget)
        batch = tree_build.build_trees(np.ascontiguousarray(draft_logprobs[None], dtype=np.float32),
                                       np.ascontiguousarray(draft_ids[None], dtype=np.int32),
                                       np.array([root_token], np.int32), np.array([prefix_len], np.int32), budget)
        packed = batch.packed.copy_to_host()  # two device reads in all: the node arrays and the count
        count = int(batch.num_nodes.copy_to_host()[0])
        built = {name: packed[row, 0, :count] for row, name in enumerate(tree_build.OUTPUT_ROWS)}
        return ddtree_ref.Tree(tokens=built["tokens"].astype(np.int64), parents=built["parents"],
                               depths=built["depths"], ranks=built["ranks"],
                               scores=built["scores"].view(np.float32), positions=built["positions"].astype(np.int64),
                               visibility=batch.visibility[0, :count])

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
