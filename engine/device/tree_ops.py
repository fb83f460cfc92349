"""DeviceTreeOps: token choice, tree build and accept of a DDTree step on the device kernels."""
from __future__ import annotations

import numpy as np
from numba import cuda

from kdspec.engine.device.logits import DeviceLogits
from kdspec.engine.device.step import DeviceSteps
from kdspec.engine.golden import ddtree as ddtree_ref
from kdspec.numba_kernels import sampling
from kdspec.numba_kernels.host_arrays import download, upload
from kdspec.numba_kernels.tree import accept as tree_accept
from kdspec.numba_kernels.tree import build as tree_build
from kdspec.traces.schema import TARGET_TOPK


class _Draft:
    """A draft's device copy, [L, K] log-probs and ids in one int32 buffer so that one copy uploads both."""

    def __init__(self, depth: int, width: int):
        self.host = np.empty((2, 1, depth, width), np.int32)
        self.device = cuda.device_array((2, 1, depth, width), np.int32)
        self.logprobs, self.ids = self.device[0].view(np.float32), self.device[1]


class _Buffers:
    """Device buffers of one budget's steps, allocated once, and their host copies: the built tree, the
    build's inputs (root / prefix length, the draft), the target's choice per node and the accept walk's
    outputs. Device views are made once too (numba's slicing costs tens of microseconds a call)."""

    def __init__(self, budget: int):
        nodes = budget + 1
        self.tree = tree_build.TreeBatch.allocate(1, budget)
        self.scalars = cuda.device_array((2, 1), np.int32)            # root token, prefix length
        self.scalars_host = np.empty((2, 1), np.int32)
        self.root_tokens, self.prefix_lens = self.scalars[0], self.scalars[1]
        self.drafts: dict[tuple[int, int], _Draft] = {}
        self.packed_host = np.empty(tuple(self.tree.packed.shape), np.int32)
        self.count_host = np.empty(1, np.int32)
        self.visibility: dict[int, object] = {}                         # node count -> tree.visibility[0, :n]
        self.choice = cuda.device_array((1, nodes), np.int32)
        self.choice_host = np.empty((1, nodes), np.int32)
        self.accepted = (cuda.device_array((1, nodes), np.int32), cuda.device_array(1, np.int32),
                         cuda.device_array(1, np.int32))
        self.accepted_host = (np.empty((1, nodes), np.int32), np.empty(1, np.int32), np.empty(1, np.int32))

    def draft_for(self, shape) -> _Draft:
        if tuple(shape) not in self.drafts:
            self.drafts[tuple(shape)] = _Draft(*shape)
        return self.drafts[tuple(shape)]

    def visibility_of(self, count: int):
        if count not in self.visibility:
            self.visibility[count] = self.tree.visibility[0, :count]
        return self.visibility[count]


class DeviceTreeOps:
    """Token choice, tree build and accept on the device kernels (one request per launch here), and the whole
    step on the device where the model allows it (``device_steps``; off: the stages one by one).

    A step's build and accept reuse one budget's device buffers, and accept walks the tree this object built
    last from its device copy (only the target's choice goes up): the host uploads and allocations were most of
    those stages' host time (BENCHMARKS.md, "Where that host time goes"). Steps must not interleave: one decode
    at a time per object."""

    def __init__(self, device_steps: bool = True):
        self.step_stamps = None  # numba_kernels.clock.Stamps for every whole step on the device (benchmarks)
        self._buffers: dict[int, _Buffers] = {}
        self._built = None   # (tokens, parents) of the last tree built, and its _Buffers
        self._use_device_steps = device_steps
        self._steps: dict[int, DeviceSteps] = {}  # id(model) -> its DeviceSteps

    def device_steps(self, model, cache, temperature: float) -> DeviceSteps | None:
        """The whole-step runner (engine/device/step.py) for decoding ``model`` over ``cache`` at
        ``temperature``, or None where it does not apply (then the loop runs the stages one by one)."""
        if not self._use_device_steps or not DeviceSteps.supports(model, cache, temperature):
            return None
        steps = self._steps.get(id(model))
        if steps is None or steps.model is not model:
            steps = self._steps[id(model)] = DeviceSteps(model)
        steps.stamps = self.step_stamps
        return steps

    def _buffers_for(self, budget: int) -> _Buffers:
        if budget not in self._buffers:
            self._buffers[budget] = _Buffers(budget)
        return self._buffers[budget]

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
            kept.keep_topk(TARGET_TOPK, host_ids, top_values, margins)  # ids already here: one copy fewer
            ids = host_ids[:, 0]
        elif temperature == 0:
            ids = sampling.argmax_rows(logits)
        else:
            ids = sampling.sample_rows(logits, float(temperature), int(seed), np.asarray(positions, dtype=np.int64))
        ids = ids.copy_to_host() if hasattr(ids, "copy_to_host") else np.asarray(ids)
        return ids.astype(np.int64)

    def build_tree(self, draft_logprobs, draft_ids, root_token: int, budget: int, prefix_len: int) -> ddtree_ref.Tree:
        """The tree on the host for accept and the record; its visibility is the build kernel's packed bitmask
        uint32 [N+1, W] left on the device (valid until the next build at this budget), which the verify
        forward hands to attention as it is."""
        ddtree_ref.check_draft(draft_logprobs, draft_ids, budget)
        buffers = self._buffers_for(budget)
        buffers.scalars_host[:, 0] = (root_token, prefix_len)
        upload(buffers.scalars, buffers.scalars_host)
        draft = buffers.draft_for(draft_ids.shape)
        draft.host[0, 0] = draft_logprobs.view(np.int32)
        draft.host[1, 0] = draft_ids
        upload(draft.device, draft.host)
        batch = tree_build.build_trees(draft.logprobs, draft.ids, buffers.root_tokens, buffers.prefix_lens, budget,
                                       out=buffers.tree)
        download(buffers.count_host, batch.num_nodes)  # two device reads in all: the count and the node arrays
        download(buffers.packed_host, batch.packed)
        count = int(buffers.count_host[0])
        packed = buffers.packed_host[:, 0, :count].copy()  # the host buffer is rewritten by the next build
        built = {name: packed[row] for row, name in enumerate(tree_build.OUTPUT_ROWS)}
        tree = ddtree_ref.Tree(tokens=built["tokens"].astype(np.int64), parents=built["parents"],
                               depths=built["depths"], ranks=built["ranks"],
                               scores=built["scores"].view(np.float32), positions=built["positions"].astype(np.int64),
                               visibility=buffers.visibility_of(count))
        self._built = (tree.tokens, tree.parents, buffers)
        return tree

    def accept(self, parents, tokens, target_choice) -> tuple[np.ndarray, int]:
        count = len(parents)
        built = self._built
        if built is not None and tokens is built[0] and parents is built[1]:
            # the tree built last: its nodes and count are on the device; only the choice goes up
            buffers = built[2]
            width = buffers.choice.shape[1]
            choice = buffers.choice_host
            choice[0, :count] = target_choice
            choice[0, count:] = -1
            upload(buffers.choice, choice)
            tree = buffers.tree
            accepted, tau, bonus = tree_accept.accept_trees(tree.parents, tree.tokens, buffers.choice,
                                                            tree.num_nodes, width - 1, out=buffers.accepted)
            for host, device in zip(buffers.accepted_host, (accepted, tau, bonus)):
                download(host, device)
            accepted, tau, bonus = buffers.accepted_host
            return accepted[0, :int(tau[0])].astype(np.int32), int(bonus[0])
        else:
            accepted, tau, bonus = tree_accept.accept_trees(np.asarray(parents, np.int32)[None],
                                                            np.asarray(tokens, np.int32)[None],
                                                            np.asarray(target_choice, np.int32)[None],
                                                            np.array([count], np.int32), count)
        host = lambda a: a.copy_to_host() if hasattr(a, "copy_to_host") else np.asarray(a)  # noqa: E731
        tau = int(host(tau)[0])
        return host(accepted)[0, :tau].astype(np.int32), int(host(bonus)[0])
