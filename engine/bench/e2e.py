"""Suite ``e2e``: k2-mini (bf16 weights) decoding on the engine's device model, AR and DDTree (oracle and
noisy:0.7 drafters, block 8, budgets 7 / 15 / 31 / 63 / 127 / 255), against a roofline and Hugging Face
transformers.

- Weights: k2-mini's seeded weights (engine.model.weights.SeededWeights), drawn on the GPU and rounded to bf16,
  so the engine (weight_dtype bfloat16) and the HF peer (DeepseekV3ForCausalLM in bf16) hold exactly the same
  numbers, the preset's own.
- No float64 golden at this size: the engine's own AR output is the "golden" continuation the oracle drafters
  know (prompt + AR tokens by absolute position); DDTree tokens are compared with it in the notes.
- Tokens per second are decode tokens (after the prefill's first token) over decode wall time; the stage
  breakdown is GenerateResult.stage_times per step. Every timed decode runs REPEATS times and the run with
  the median decode time is reported (single runs of the same decode were seen 30% apart on the H200).
- Roofline of a forward: max(memory time, compute time), both ceilings measured in the same run.
  Memory: the bytes it must move (linear weights it touches in bf16 — attention, dense MLP, router, shared
  expert, the distinct routed experts picked in that step counted once, lm_head — plus the KV cache rows read,
  fp32) over the copy bandwidth. Compute: its FLOPs (step_flops) over the bf16 tensor-core peak (torch's bf16
  matmul); without torch, the memory time alone. Distinct experts are counted in a separate instrumented pass
  per budget (the timed runs are not instrumented).
"""
from __future__ import annotations

import gc
import time
from functools import partial
from typing import NamedTuple

import numpy as np

from kdspec.engine.bench.common import ceilings, progress, row, torch_cuda
from kdspec.engine.decode.config import DecodeConfig
from kdspec.engine.decode.drafters import parse_drafter
from kdspec.engine.decode.loop import generate
from kdspec.engine.model.config import PRESETS, ModelConfig
from kdspec.engine.model.weights import SeededWeights, parameter_shapes, random_weights
from kdspec.numba_kernels.runtime import ON_SIMULATOR
from kdspec.traces.schema import STAGES

SUITE = "e2e"
BLOCK_SIZE = 8
BUDGETS = (7, 15, 31, 63, 127, 255)   # trees of 8 .. 256 nodes, the root included
DRAFTERS = ("oracle", "noisy:0.7")
REPEATS = 3               # timed decodes per configuration: the median run is reported
ROOFLINE_FACTOR = 2.0      # a verify step within 2x of its roofline
AR_ROOFLINE_FACTOR = 1.3   # the AR step within 1.3x of its roofline (issue #19)
HOST_TARGET = 0.3e-3       # seconds of host time per DDTree step (wall time the GPU is idle)
# Issue #19's speed targets, DDTree tokens/s over AR's: (drafter, budgets, least ratio, strictly above it)
SPEED_TARGETS = (("oracle", (7,), 4.5, False), ("oracle", (255,), 1.0, True), ("noisy:0.7", (7, 15, 31, 63), 1.0, True))
HF_TARGET = 2.0            # engine AR >= 2x HF transformers AR
WEIGHT_BYTES = 2           # bf16 storage of every linear weight on the device

_LOADED: dict = {}        # quick -> load_model's result
MODEL_SUITES = ("e2e", "trace")  # the suites that run load_model's cached model


# -------------------------------------------------------------------------------------------- HF peer
def hf_state_dict(torch, cfg: ModelConfig, tensors: dict) -> dict:
    """Our HF per-expert names -> transformers 5.x DeepseekV3 names: each MoE layer's experts fused into
    mlp.experts.gate_up_proj [e, 2f, d] (gate rows, then up rows) and mlp.experts.down_proj [e, d, f]."""
    sd = {k: v for k, v in tensors.items() if ".mlp.experts." not in k}
    for layer in range(cfg.num_hidden_layers):
        if not cfg.is_moe_layer(layer):
            continue
        p = f"model.layers.{layer}.mlp.experts."
        experts = range(cfg.n_routed_experts)
        sd[p + "gate_up_proj"] = torch.stack([torch.cat([tensors[f"{p}{e}.gate_proj.weight"],
                                                         tensors[f"{p}{e}.up_proj.weight"]]) for e in experts])
        sd[p + "down_proj"] = torch.stack([tensors[f"{p}{e}.down_proj.weight"] for e in experts])
    return sd


def hf_model(cfg: ModelConfig, tensors: dict, dtype, device: str):
    """transformers' DeepseekV3ForCausalLM holding ``tensors`` (HF name -> torch tensor). RoPE needs no
    permutation: HF's default rope_interleave=True takes the official adjacent-pair layout we use."""
    import torch
    import transformers
    config = transformers.DeepseekV3Config(**cfg.to_hf_dict())
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = transformers.DeepseekV3ForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    missing, unexpected = model.load_state_dict(hf_state_dict(torch, cfg, tensors), strict=False)
    missing = [k for k in missing if "rotary" not in k]
    if missing or unexpected:
        raise RuntimeError(f"HF weight mapping: missing {missing[:1]}, unexpected {unexpected[:1]}")
    return model.eval()  # parameters already in dtype; no .to(dtype): it would round RoPE's fp32 inv_freq


def hf_greedy(torch, model, prompt: np.ndarray, new_tokens: int, device: str) -> tuple[np.ndarray, float]:
    """Greedy AR with HF's KV cache: (tokens int64 [new_tokens], decode seconds after the prefill's token)."""
    with torch.no_grad():
        ids = torch.as_tensor(prompt, device=device)[None]
        out = model(ids, use_cache=True)
        cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        tokens = [token]
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(new_tokens - 1):
            out = model(token, past_key_values=cache, use_cache=True)
            cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(token)
        result = torch.cat(tokens, dim=1)[0].cpu().numpy()  # waits for the GPU
        return result, time.perf_counter() - start


# ------------------------------------------------------------------------------------------- roofline
class ExpertCounter:
    """Instruments a DeviceModel instance: per forward, (s, cache length, distinct routed experts per MoE
    layer). Routing is recomputed beside the model's own (identical inputs), only while installed."""

    def __init__(self, model):
        from kdspec.numba_kernels.moe import router as moe_router
        self.model, self.forwards, self._layers = model, [], []
        self._moe, self._forward = model._moe, model.forward
        options = moe_router.router_options(model.cfg)

        def moe(layer, x, stream=0):
            ids, _ = moe_router.route_experts(model.ops.linear(x, layer["router"]), layer["router_bias"], **options)
            ids = ids.copy_to_host() if hasattr(ids, "copy_to_host") else np.asarray(ids)
            self._layers.append(len(np.unique(ids)))
            return self._moe(layer, x, stream)

        def forward(cache, tokens, positions, visibility=None):
            self._layers = []
            prefix = cache.length
            logits = self._forward(cache, tokens, positions, visibility)
            self.forwards.append((len(tokens), prefix, list(self._layers)))
            return logits

        model._moe, model.forward = moe, forward
        # Counting reads the routing back to the host inside the layer stack: the forward runs eagerly meanwhile
        # (a captured graph would not call _moe at all).
        self._use_graphs, model.use_graphs = model.use_graphs, False

    def remove(self) -> None:
        del self.model._moe, self.model.forward  # back to the class's methods
        self.model.use_graphs = self._use_graphs


def step_bytes(cfg: ModelConfig, tokens: int, prefix_len: int, distinct_per_layer: list[int]) -> float:
    """Bytes one forward of ``tokens`` new rows after ``prefix_len`` cached rows must move (see module doc)."""
    shapes = parameter_shapes(cfg)
    size = lambda name: float(np.prod(shapes[name]))  # noqa: E731
    f = cfg.moe_intermediate_size
    expert = 3 * cfg.hidden_size * f * WEIGHT_BYTES
    moe_layers = iter(distinct_per_layer)
    total = 0.0
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}."
        for name, shape in shapes.items():
            if not name.startswith(p) or ".mlp.experts." in name:
                continue
            total += size(name) * (WEIGHT_BYTES if len(shape) == 2 else 4)  # norms and biases stay fp32
        if cfg.is_moe_layer(layer):
            total += next(moe_layers, cfg.n_routed_experts) * expert
    total += size("lm_head.weight" if not cfg.tie_word_embeddings else "model.embed_tokens.weight") * WEIGHT_BYTES
    total += size("model.norm.weight") * 4
    total += tokens * cfg.hidden_size * WEIGHT_BYTES  # embedding rows
    row_bytes = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4 * cfg.num_hidden_layers
    total += (prefix_len + tokens) * row_bytes + tokens * row_bytes  # rows read, new rows written
    return total


def step_flops(cfg: ModelConfig, tokens: int, prefix_len: int) -> float:
    """FLOPs of one forward of ``tokens`` new rows after ``prefix_len`` cached rows: 2 per multiply-add. Every row
    goes through every linear weight of its layers (a MoE layer's router, shared expert and its top-k routed
    experts only) and lm_head; MLA attention (absorbed: kv_b_proj counted as a linear weight) scores and sums
    over prefix_len + tokens keys per head, the keys a tree-verify launch reads (masked ones included), in the
    latent + rope width for scores and the latent width for values."""
    shapes = parameter_shapes(cfg)
    f = cfg.moe_intermediate_size
    per_row = 0.0
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}."
        per_row += sum(float(np.prod(shape)) for name, shape in shapes.items()
                       if name.startswith(p) and len(shape) == 2 and ".mlp.experts." not in name)
        if cfg.is_moe_layer(layer):
            per_row += cfg.num_experts_per_tok * 3 * cfg.hidden_size * f
    per_row += float(np.prod(shapes["lm_head.weight" if not cfg.tie_word_embeddings else "model.embed_tokens.weight"]))
    keys = prefix_len + tokens
    attention = cfg.num_attention_heads * keys * (2 * cfg.kv_lora_rank + cfg.qk_rope_head_dim) * cfg.num_hidden_layers
    return 2.0 * tokens * (per_row + attention)


def roofline_seconds(cfg: ModelConfig, forwards: list, ceiling: dict) -> tuple[float, float, float]:
    """(roofline, memory time, compute time) of the mean forward of ``forwards`` [(s, cache length, distinct
    experts per MoE layer)]; compute time 0 without a tensor-core ceiling."""
    memory = np.mean([step_bytes(cfg, s, p, d) for s, p, d in forwards]) / ceiling["copy_bytes_per_s"]
    peak = ceiling.get("tensor_core_flops")
    compute = np.mean([step_flops(cfg, s, p) for s, p, _ in forwards]) / peak if peak else 0.0
    return max(memory, compute), memory, compute


# ------------------------------------------------------------------------------------------ the model
def load_model(quick: bool):
    """(cfg, DeviceModel, tree_ops, torch tensors or None): k2-mini bf16 on the GPU (quick: tiny, fp32, numpy
    weights, on the simulator or the GPU; its HF peer runs on the CPU). Cached for the trace suite."""
    if quick in _LOADED:
        return _LOADED[quick]
    from kdspec.engine.device.model import DeviceModel
    from kdspec.engine.device.tree_ops import DeviceTreeOps
    torch = torch_cuda()
    if quick:
        cfg = PRESETS["tiny"]
        weights = random_weights(cfg, 0)
        model = DeviceModel(cfg, weights, "sim" if ON_SIMULATOR else "cuda")
        tensors = None
        try:
            import torch as cpu_torch
            tensors = {k: cpu_torch.from_numpy(v) for k, v in weights.items()}
        except ImportError:
            pass
    else:
        if torch is None:
            raise RuntimeError("the e2e suite needs a CUDA GPU with torch")
        cfg = PRESETS["k2-mini"]
        weights = SeededWeights(cfg, 0)
        progress("e2e: building the device model (k2-mini's seeded weights drawn on the GPU, bf16)")
        model = DeviceModel(cfg, weights, "cuda", weight_dtype="bfloat16")
        progress("e2e: the same weights for the HF peer (bf16)")
        tensors = {name: weights.draw(torch, name).to(torch.bfloat16) for name in weights}
    _LOADED[quick] = (cfg, model, DeviceTreeOps(), tensors)
    return _LOADED[quick]


def release_model(quick: bool) -> None:
    """Drop the cached model (the runner calls it after the last suite in MODEL_SUITES), so that the suites after it
    get the GPU's memory back: k2-mini's bf16 weights and graphs hold about 50 GB."""
    if _LOADED.pop(quick, None) is not None:
        gc.collect()
        torch = torch_cuda()
        if torch is not None:
            torch.cuda.empty_cache()


def release_tensors(quick: bool) -> None:
    """Drop the torch copies of the weights (the HF peer is done with them)."""
    if quick in _LOADED:
        cfg, model, ops, _ = _LOADED[quick]
        _LOADED[quick] = (cfg, model, ops, None)
        torch = torch_cuda()
        if torch is not None:
            gc.collect()
            torch.cuda.empty_cache()


def decode_rate(result) -> tuple[float, float]:
    """(decode tokens per second after the prefill's token, seconds per step)."""
    decode_time = result.elapsed - result.prefill_time
    return sum(result.taus) / decode_time, decode_time / max(result.steps, 1)


def median_run(decode, repeats: int):
    """Run ``decode()`` (a generate call) ``repeats`` times; the result with the median decode time. The
    runs are deterministic: a run whose tokens differ from the first is an engine bug, raised here."""
    results = [decode() for _ in range(repeats)]
    for result in results[1:]:
        if not np.array_equal(result.tokens, results[0].tokens):
            raise RuntimeError("e2e: two runs of the same decode produced different tokens")
    return sorted(results, key=lambda r: r.elapsed - r.prefill_time)[len(results) // 2]


class _Plan(NamedTuple):
    """What one e2e run decodes: the prompt, the token count, the DDTree grid and the generate arguments."""
    quick: bool
    prompt: np.ndarray
    new_tokens: int
    block: int
    budgets: tuple
    drafters: tuple
    repeats: int
    run_args: dict


def _plan(cfg: ModelConfig, ops, quick: bool) -> _Plan:
    # quick: the simulator runs a tiny-model step in seconds, so as few steps as still exercise every path
    new_tokens, block, budgets, drafters = (4, 3, (2,), DRAFTERS[:1]) if quick else (64, BLOCK_SIZE, BUDGETS, DRAFTERS)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, cfg.vocab_size, 4 if quick else 32).astype(np.int64)
    return _Plan(quick, prompt, new_tokens, block, budgets, drafters, 1 if quick else REPEATS,
                 dict(tree_ops=ops))


def run(quick: bool = False) -> list[dict]:
    cfg, model, ops, tensors = load_model(quick)
    plan = _plan(cfg, ops, quick)
    ceiling = ceilings(quick)
    if not quick:  # the simulator compiles nothing
        _warm_up(cfg, model, plan)
    progress(f"e2e: AR, {plan.new_tokens} tokens")
    # block more tokens than DDTree decodes: the oracle's golden continuation covers its last step.
    ar = median_run(lambda: generate(model, plan.prompt, DecodeConfig(plan.new_tokens + plan.block), **plan.run_args),
                    plan.repeats)
    ar_rate, ar_step = decode_rate(ar)
    golden = np.concatenate([plan.prompt, ar.tokens])
    rows = [row(SUITE, "AR tokens/s", ar_rate, "tok/s",
                note=f"{ar_step * 1e3:.3g} ms/step over {ar.steps} steps (median of {plan.repeats} runs)")]
    ddtree = _ddtree_runs(cfg, model, plan, golden)
    rows.extend(_ddtree_row(spec, budget, result, ar, ar_rate, plan.new_tokens)
                for (spec, budget), result in ddtree.items())
    ar_forwards, verify_forwards = _count_experts(cfg, model, plan, golden)
    rows.extend(_roofline_rows(cfg, plan, ceiling, ar_forwards, verify_forwards, ar_step, ar_rate, ddtree))
    rows.extend(_host_time_rows(cfg, model, plan, golden))
    rows.extend(_hf_rows(cfg, tensors, plan.prompt, plan.new_tokens, ar, ar_rate, quick, precision(model)))
    release_tensors(quick)
    return rows


def _drafter(cfg: ModelConfig, plan: _Plan, spec: str, golden: np.ndarray, budget: int):
    """The ``spec`` drafter over ``golden`` for one budget: L = block - 1 depths, K = min(B, V) candidates."""
    return parse_drafter(spec).build(golden, plan.block - 1, min(budget, cfg.vocab_size), cfg.vocab_size, seed=0)


def _warm_up(cfg: ModelConfig, model, plan: _Plan) -> None:
    """Compile every kernel the timed runs launch: a short AR decode and an oracle DDTree one per budget."""
    progress("e2e: warm-up (kernel compilation)")
    generate(model, plan.prompt, DecodeConfig(3), **plan.run_args)
    warm_golden = np.concatenate([plan.prompt, np.zeros(64, np.int64)])
    for budget in plan.budgets:
        drafter = _drafter(cfg, plan, "oracle", warm_golden, budget)
        generate(model, plan.prompt, DecodeConfig(3, mode="ddtree", block_size=plan.block, budget=budget), drafter,
                 **plan.run_args)


def _ddtree_runs(cfg: ModelConfig, model, plan: _Plan, golden: np.ndarray) -> dict:
    """(drafter spec, budget) -> the median DDTree result, drafters knowing the AR run's tokens as golden."""
    ddtree = {}
    for spec in plan.drafters:
        for budget in plan.budgets:
            progress(f"e2e: DDTree {spec} budget {budget}")
            drafter = _drafter(cfg, plan, spec, golden, budget)
            config = DecodeConfig(plan.new_tokens, mode="ddtree", block_size=plan.block, budget=budget)
            ddtree[spec, budget] = median_run(lambda: generate(model, plan.prompt, config, drafter, **plan.run_args),
                                              plan.repeats)
    return ddtree


def speed_target(spec: str, budget: int) -> tuple[str, object]:
    """(target text, predicate on the ratio to AR) of a DDTree run: SPEED_TARGETS, or none."""
    for drafter, budgets, least, strictly in SPEED_TARGETS:
        if drafter == spec and budget in budgets:
            return (f"> {least:g}x AR" if strictly else f">= {least:g}x AR",
                    (lambda r: r > least) if strictly else (lambda r: r >= least))
    return "", None


def _ddtree_row(spec: str, budget: int, result, ar, ar_rate: float, new_tokens: int) -> dict:
    """The run's tokens/s against AR's; target: its output equals AR's (every run) and SPEED_TARGETS."""
    rate, step = decode_rate(result)
    same = int(np.sum(result.tokens == ar.tokens[:new_tokens]))
    stages = ", ".join(f"{s} {result.stage_times[s] / result.steps * 1e3:.3g}" for s in STAGES)
    speed, fast_enough = speed_target(spec, budget)
    ok = same == new_tokens and (fast_enough is None or fast_enough(rate / ar_rate))
    return row(SUITE, f"DDTree {spec} B={budget} tokens/s", rate, "tok/s", peer="engine AR", peer_value=ar_rate,
               target=f"output = AR{', ' + speed if speed else ''}", ok=ok,
               note=f"tau {result.mean_tau:.2f}; {step * 1e3:.3g} ms/step ({stages} ms); "
                    f"{same}/{new_tokens} tokens = AR")


def _count_experts(cfg: ModelConfig, model, plan: _Plan, golden: np.ndarray) -> tuple[list, dict]:
    """(AR forwards, budget -> DDTree verify forwards) of an instrumented AR run and an oracle run per budget,
    each forward (s, cache length, distinct routed experts per MoE layer), the prefills left out."""
    progress("e2e: counting distinct experts per step (instrumented pass)")
    from kdspec.engine.device.tree_ops import DeviceTreeOps
    counter = ExpertCounter(model)
    # stage by stage: a step on the device runs no model.forward for the counter to see
    run_args = dict(plan.run_args, tree_ops=DeviceTreeOps(device_steps=False))
    verify_forwards = {}
    try:
        generate(model, plan.prompt, DecodeConfig(2 if plan.quick else 16), **run_args)
        ar_forwards = counter.forwards[1:]  # [0] is the prefill
        for budget in plan.budgets:
            counter.forwards = []
            drafter = _drafter(cfg, plan, "oracle", golden, budget)
            generate(model, plan.prompt, DecodeConfig(2 if plan.quick else plan.new_tokens, mode="ddtree",
                                                      block_size=plan.block, budget=budget), drafter, **run_args)
            verify_forwards[budget] = counter.forwards[1:]
    finally:
        counter.remove()
    return ar_forwards, verify_forwards


def _roofline_rows(cfg: ModelConfig, plan: _Plan, ceiling: dict, ar_forwards: list, verify_forwards: dict,
                   ar_step: float, ar_rate: float, ddtree: dict) -> list[dict]:
    """The AR step and the oracle's verify step at every budget against their rooflines, and the speed-up the
    rooflines and the oracle's tau predict at the first budget."""
    quick, first = plan.quick, plan.budgets[0]
    experts = lambda forwards: np.mean([np.mean(d) for _, _, d in forwards]) if cfg.has_moe else 0.0  # noqa: E731
    ar_roof, ar_memory, ar_compute = roofline_seconds(cfg, ar_forwards, ceiling)
    rows = [row(SUITE, "AR step vs roofline", ar_step * 1e3, "ms", peer="roofline", peer_value=ar_roof * 1e3,
                ratio=ar_roof / ar_step, target=f"<= {AR_ROOFLINE_FACTOR:g}x roofline",
                ok=None if quick else ar_step <= AR_ROOFLINE_FACTOR * ar_roof,
                note=f"whole AR step; memory {ar_memory * 1e3:.3g} ms, compute {ar_compute * 1e3:.3g} ms; "
                     f"{experts(ar_forwards):.1f} distinct experts/layer; ratio = roofline / measured")]
    for budget in plan.budgets:
        oracle = ddtree["oracle", budget]
        roof, memory, compute = roofline_seconds(cfg, verify_forwards[budget], ceiling)
        verify_step = oracle.stage_times["verify"] / oracle.steps
        flops = np.mean([step_flops(cfg, s, p) for s, p, _ in verify_forwards[budget]])
        rows.append(row(SUITE, f"DDTree verify step B={budget} vs roofline", verify_step * 1e3, "ms",
                        peer="roofline", peer_value=roof * 1e3, ratio=roof / verify_step,
                        target=f"<= {ROOFLINE_FACTOR:g}x roofline",
                        ok=None if quick else verify_step <= ROOFLINE_FACTOR * roof,
                        note=f"oracle's verify stage (forward + token choice); memory {memory * 1e3:.3g} ms, "
                             f"compute {compute * 1e3:.3g} ms ({flops / 1e12:.3g} TFLOP); "
                             f"{experts(verify_forwards[budget]):.1f} distinct experts/layer"))
    oracle = ddtree["oracle", first]
    oracle_rate, _ = decode_rate(oracle)
    predicted = oracle.mean_tau * ar_roof / roofline_seconds(cfg, verify_forwards[first], ceiling)[0]
    rows.append(row(SUITE, f"DDTree oracle B={first} / AR speed-up", oracle_rate / ar_rate, "x",
                    peer="roofline prediction", peer_value=predicted, ratio=None, target="> 1x",
                    ok=None if quick else oracle_rate > ar_rate,
                    note=f"prediction = tau {oracle.mean_tau:.2f} x AR roofline / verify roofline"))
    return rows


def busy_seconds(intervals: list, start: float, end: float) -> float:
    """Length of the union of ``intervals`` [(begin, end)] clipped to [start, end] (any one unit)."""
    busy, reach = 0.0, start
    for begin, finish in sorted(intervals):
        begin, finish = max(begin, reach), min(finish, end)
        if finish > begin:
            busy += finish - begin
            reach = finish
    return busy


def profiled_busy(decode) -> tuple[float, int]:
    """(GPU-busy seconds, steps) of the decode after the prefill of ``decode()`` (a generate call), run once under
    torch's profiler (CUPTI records every kernel and copy of the process, Numba's included): the union of the
    GPU's busy intervals within the decode window, the last ``elapsed - prefill_time`` seconds before the last
    GPU activity ends (the decode ends reading its tokens back)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as profiler:
        result = decode()
    intervals = [(e.time_range.start * 1e-6, e.time_range.end * 1e-6) for e in profiler.events()
                 if e.device_type == DeviceType.CUDA]
    if not intervals:
        raise RuntimeError("the profiler recorded no GPU activity")
    wall = result.elapsed - result.prefill_time
    end = max(finish for _, finish in intervals)
    return busy_seconds(intervals, end - wall, end), result.steps


def stamped_host_time(decode, stamps, repeats: int) -> tuple[float, float, int]:
    """(host seconds, GPU-busy seconds, steps) per step of the decode ``decode()`` (a generate call whose steps run
    on the device with ``stamps``, numba_kernels/clock.py): decode wall time minus the GPU's busy time, both from
    the same unprofiled run, the run with the median host time of ``repeats``. The busy time of a step is the
    span from its first launch to its last on the GPU's own clock; idle gaps between a step's own kernels count
    as busy (the GPU's, not the host's), the time from a step's end to the next step's first launch does not
    (the host reading the results, drafting, launching)."""
    measured = []
    for _ in range(repeats):
        stamps.clear()
        result = decode()
        spans = stamps.spans()
        if len(spans) != result.steps:
            raise RuntimeError(f"e2e: {result.steps} steps but {len(spans)} stamped spans")
        busy = float((spans[:, 1] - spans[:, 0]).sum())
        wall = result.elapsed - result.prefill_time
        measured.append(((wall - busy) / result.steps, busy / result.steps, result.steps))
    return sorted(measured)[len(measured) // 2]


def _host_time_rows(cfg: ModelConfig, model, plan: _Plan, golden: np.ndarray) -> list[dict]:
    """Host time per step (wall time the GPU is idle, waiting for the host) of AR and of the oracle at every
    budget, after the timed runs: stamped_host_time over plan.repeats runs after a warm-up run (the stamped steps
    are graphs of their own). The note adds the earlier measure: the stamped runs' wall time per step minus the
    GPU busy time per step that torch's profiler reads in one more run (kernels and copies; it counts gaps
    between a step's kernels as idle, and compares two runs)."""
    if plan.quick:   # the simulator has no profiler to read; the full suite needs torch on a GPU anyway
        return []
    from kdspec.numba_kernels.clock import Stamps
    target = f"<= {HOST_TARGET * 1e3:g} ms"
    runs = {"AR": lambda: generate(model, plan.prompt, DecodeConfig(plan.new_tokens), **plan.run_args)}
    for budget in plan.budgets:
        drafter = _drafter(cfg, plan, "oracle", golden, budget)
        config = DecodeConfig(plan.new_tokens, mode="ddtree", block_size=plan.block, budget=budget)
        runs[f"DDTree oracle B={budget}"] = partial(generate, model, plan.prompt, config, drafter, **plan.run_args)
    tree_ops = plan.run_args["tree_ops"]
    rows = []
    for name, decode in runs.items():
        progress(f"e2e: host time of {name} (stamped, then profiled)")
        tree_ops.step_stamps = stamps = Stamps(plan.new_tokens + 1)
        try:
            decode()  # a warm-up: its second step of each shape captures the stamped graph
            host, busy, steps = stamped_host_time(decode, stamps, plan.repeats)
        finally:
            tree_ops.step_stamps = None
        decode()  # the unstamped graphs again, warm
        kernels_busy, profiled_steps = profiled_busy(decode)
        if profiled_steps != steps:
            raise RuntimeError(f"e2e: {name} took {steps} steps stamped and {profiled_steps} profiled")
        rows.append(row(SUITE, f"{name} host time per step", host * 1e3, "ms", peer="GPU busy per step",
                        peer_value=busy * 1e3, target=target if name != "AR" else None,
                        ok=None if name == "AR" else host <= HOST_TARGET,
                        note=f"{steps} steps; host = decode wall - GPU busy per step, both from one unprofiled run "
                             f"(median of {plan.repeats}; busy from stamps of the GPU's clock at each step's "
                             f"first and last launch); wall - the profiler's kernel-busy time "
                             f"({kernels_busy / steps * 1e3:.3g} ms a step, another run): "
                             f"{host * 1e3 + (busy - kernels_busy / steps) * 1e3:.3g} ms"))
    return rows


def precision(model) -> str:
    """How the engine's device model computes, in words (for the HF row's note)."""
    if model.weight_dtype != "bfloat16":
        return "fp32"
    parts = ["bf16 dense products"]
    if getattr(model, "grouped_experts", False):
        parts.append("bf16 routed experts with bf16 outputs (torch's grouped GEMM)")
    elif getattr(model, "tensor_core_experts", False):
        parts.append("bf16 routed experts")
    if getattr(model, "tensor_core_attention", False):
        parts.append("tf32 attention")
    return ", ".join(parts) + ", the rest fp32" + (", batch-invariant" if model.batch_invariant else "")


def _hf_rows(cfg, tensors, prompt, new_tokens, ar, ar_rate, quick, engine_precision: str) -> list[dict]:
    """The Hugging Face transformers peer: same weights, same GPU (CPU under quick), greedy AR."""
    try:
        import torch
        import transformers  # noqa: F401
    except ImportError:
        return [row(SUITE, "engine AR vs HF transformers AR", ar_rate, "tok/s", peer="HF transformers",
                    note="skipped: torch/transformers not installed")]
    if tensors is None:
        return [row(SUITE, "engine AR vs HF transformers AR", ar_rate, "tok/s", peer="HF transformers",
                    note="skipped: no torch copy of the weights")]
    device = "cpu" if quick else "cuda"
    dtype = torch.float32 if quick else torch.bfloat16
    progress(f"e2e: HF transformers peer ({dtype}, {device})")
    model = hf_model(cfg, tensors, dtype, device)
    hf_greedy(torch, model, prompt, 3, device)  # warm-up
    tokens, seconds = hf_greedy(torch, model, prompt, new_tokens, device)
    hf_rate = (new_tokens - 1) / seconds
    same = int(np.cumprod(tokens == ar.tokens[:new_tokens]).sum())
    del model
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return [row(SUITE, "engine AR vs HF transformers AR", ar_rate, "tok/s", peer=f"HF transformers {str(dtype)[6:]}",
                peer_value=hf_rate, target=f">= {HF_TARGET:g}x", ok=None if quick else ar_rate >= HF_TARGET * hf_rate,
                note=f"HF greedy with its KV cache; first {same}/{new_tokens} tokens agree with the engine "
                     f"(HF computes in {str(dtype)[6:]}; the engine: {engine_precision})")]
