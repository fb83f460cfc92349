"""The engine's Python API: ``load(model, backend, seed) -> Engine``; ``Engine.generate`` and ``Engine.golden``.

    engine = load("tiny", backend="reference")
    result = engine.generate("hello", DecodeConfig(24, mode="ddtree", drafter="noisy:0.6"), on_step=writer.write_step)

Backends (docs/architecture.md, "Backends"): "reference" runs the float64 golden model itself as the engine; "sim" and
"cuda" run the Numba device model (engine/device/model.py); "auto" takes the best available one.

The golden (the float64 AR run a decode is compared with) runs where ``Engine.plan_golden`` says: "cpu" (numpy),
"gpu" (the same math in torch float64 on the GPU) or "none"; "auto" takes the GPU for a run on cuda whose float64
weights fit the GPU's free memory, else the CPU while they fit half the RAM, else none.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Union

import numpy as np

from kdspec.engine.decode.config import DecodeConfig
from kdspec.engine.decode.drafters import BlockDrafter, parse_drafter
from kdspec.engine.decode.loop import GenerateResult, check_prompt, generate
from kdspec.engine.golden.model import GoldenRun, ReferenceModel, decode
from kdspec.engine.golden.sampling import check_temperature
from kdspec.engine.model.checkpoint import load_model, model_directory, model_tokenizer
from kdspec.engine.model.config import ModelConfig
from kdspec.engine.model.drafter import DRAFTER_DIR, DrafterError, load_drafter
from kdspec.engine.model.weights import SeededWeights, parameter_count

BACKENDS = ("reference", "sim", "cuda", "auto")
WEIGHT_DTYPES = ("float32", "bfloat16")
GOLDENS = ("auto", "cpu", "gpu", "none")
# "auto" computes the golden on the CPU only while its float64 weights (8 bytes a parameter) take at most this
# share of the RAM: the numpy golden holds them there, and past it the host would swap (or the run take hours).
GOLDEN_RAM_SHARE = 0.5
# ... and on the GPU only when its float64 weights leave this much of the free GPU memory for activations, the
# golden's cache and its logits (a prefill's [P, V] float64).
GOLDEN_GPU_HEADROOM = 2 << 30


class BackendUnavailable(RuntimeError):
    """The backend asked for cannot run here; the message says why and what to use instead."""


def _device_model(backend: str, cfg: ModelConfig, weights: dict, weight_dtype: str = "float32"):
    """The Numba device model on ``cuda`` (needs a GPU and torch) or ``sim`` (the CUDA simulator)."""
    from numba import cuda
    from numba.cuda import config as cuda_config

    simulated = bool(cuda_config.ENABLE_CUDASIM)
    if backend == "sim" and not simulated:
        raise BackendUnavailable("backend 'sim' needs NUMBA_ENABLE_CUDASIM=1 set before numba is imported")
    if backend == "cuda":
        if simulated or not cuda.is_available():
            raise BackendUnavailable("backend 'cuda' needs a CUDA GPU (none is available here)")
        try:
            import torch  # noqa: F401  (cuBLAS for the dense projections)
        except ImportError:
            raise BackendUnavailable("backend 'cuda' needs torch for cuBLAS: pip install 'kdspec[gpu]'") from None
    if backend == "sim":
        from kdspec.numba_kernels.attention.common import MAX_LATENT, MAX_ROPE
        if cfg.kv_lora_rank > MAX_LATENT or cfg.qk_rope_head_dim > MAX_ROPE:
            raise BackendUnavailable(f"backend 'sim' runs toy shapes only (kv_lora_rank <= {MAX_LATENT}, "
                                     f"qk_rope_head_dim <= {MAX_ROPE}; this model has {cfg.kv_lora_rank} and "
                                     f"{cfg.qk_rope_head_dim}): use backend 'reference'")
    from kdspec.engine.device.model import DeviceModel
    return DeviceModel(cfg, weights, backend, weight_dtype)


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def gpu_golden_unavailable() -> str | None:
    """Why the golden cannot run on a GPU here (no torch, or torch without a CUDA GPU), or None when it can."""
    try:
        import torch
    except ImportError:
        return "the GPU golden needs torch with CUDA (pip install 'kdspec[gpu]')"
    if not torch.cuda.is_available():
        return f"the GPU golden needs a CUDA GPU, and torch {torch.__version__} sees none"
    return None


def _free_gpu_memory() -> int:
    """Bytes a new allocation can take on the current GPU: the driver's free memory plus what torch's caching
    allocator holds unused (the device model allocates through it)."""
    import torch
    free, _ = torch.cuda.mem_get_info()
    return int(free + torch.cuda.memory_reserved() - torch.cuda.memory_allocated())


def _gib(n: int) -> str:
    return f"{n / 2 ** 30:.1f} GiB"


@dataclass(frozen=True)
class GoldenPlan:
    """Where the golden runs: ``where`` "cpu" (numpy), "gpu" (torch float64 on cuda) or "none", and why."""

    where: str
    reason: str

    @property
    def device(self) -> str | None:
        """The torch device of Engine.golden's ``device`` argument: None (numpy) on the CPU, "cuda" on the GPU."""
        return "cuda" if self.where == "gpu" else None


class Engine:
    """A loaded model ready to decode. ``cfg`` the ModelConfig, ``backend`` the one in use, ``model`` the
    object with the model protocol, ``reference`` the float64 golden over the same weights, ``weight_dtype`` how
    the device model stores its weights."""

    def __init__(self, cfg: ModelConfig, weights: dict, backend: str, model, seed: int, source: str,
                 weight_dtype: str = "float32"):
        self.cfg, self.weights, self.backend, self.model, self.seed, self.source = cfg, weights, backend, model, seed, source
        self.weight_dtype = weight_dtype
        self.tokenizer = model_tokenizer(source)
        self._reference = model if isinstance(model, ReferenceModel) else None
        self.tree_ops = None
        if backend in ("sim", "cuda"):
            from kdspec.engine.device.tree_ops import DeviceTreeOps
            self.tree_ops = DeviceTreeOps()

    @property
    def reference(self) -> ReferenceModel:
        """The float64 golden over the same weights. Where memory allows (a float64 copy under half the RAM),
        the weights are widened once instead of per use: a k2-mini golden token then takes a fraction of a
        second instead of seconds."""
        if self._reference is None:
            weights = self.weights
            if isinstance(weights, SeededWeights):
                weights = weights.materialize()  # every tensor at once, in threads
            if 8 * parameter_count(weights) < _physical_memory() // 2:
                weights = {name: w.astype(np.float64) for name, w in weights.items()}
            self._reference = ReferenceModel(self.cfg, weights)
        return self._reference

    def golden_bytes(self) -> int:
        """The golden's float64 weights: 8 bytes a parameter."""
        return 8 * parameter_count(self.weights)

    def plan_golden(self, choice: str = "auto") -> GoldenPlan:
        """Where the golden runs for ``choice`` (GOLDENS). "gpu" raises BackendUnavailable without torch + CUDA.
        "auto": the GPU for a run on cuda when the float64 weights fit the free GPU memory (less
        GOLDEN_GPU_HEADROOM), else the CPU when they take at most GOLDEN_RAM_SHARE of the RAM, else none."""
        if choice not in GOLDENS:
            raise ValueError(f"golden must be one of {', '.join(GOLDENS)}, got {choice!r}")
        if choice == "gpu":
            missing = gpu_golden_unavailable()
            if missing:
                raise BackendUnavailable(missing)
            return GoldenPlan("gpu", "asked for")
        if choice != "auto":
            return GoldenPlan(choice, "asked for")
        need, ram = self.golden_bytes(), _physical_memory()
        if self.backend == "cuda" and gpu_golden_unavailable() is None:
            free = _free_gpu_memory()
            if need + GOLDEN_GPU_HEADROOM <= free:
                return GoldenPlan("gpu", f"float64 weights {_gib(need)} fit the GPU's {_gib(free)} free")
        if need <= GOLDEN_RAM_SHARE * ram:
            return GoldenPlan("cpu", f"float64 weights {_gib(need)} within half the RAM ({_gib(ram)})")
        return GoldenPlan("none", f"float64 weights {_gib(need)} exceed half the RAM ({_gib(ram)})"
                          + (" and the free GPU memory" if self.backend == "cuda" else ""))

    def encode_prompt(self, prompt: Union[str, np.ndarray, list]) -> np.ndarray:
        """Text (the model's tokenizer) or token ids -> int64 [P0]. Ids are checked by generate()."""
        return np.asarray(self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt)

    def golden(self, prompt, max_new_tokens: int, temperature: float = 0.0, seed: int | None = None,
               device: str | None = None) -> GoldenRun:
        """The float64 golden AR run of ``max_new_tokens`` after ``prompt`` (engine.golden.model.decode).

        device: None computes with numpy (``reference``); a torch device ("cuda", "cpu") runs the same math in
        torch float64 there, its weights widened on it for this call only (freed after). The run is on the host.
        """
        seed = self.seed if seed is None else seed
        temperature = check_temperature(temperature)  # before the prefill, not at the first token
        if device is None:
            return decode(self.reference, self.encode_prompt(prompt), max_new_tokens, temperature, seed)
        model = ReferenceModel(self.cfg, self.weights, device=device)
        try:
            return decode(model, self.encode_prompt(prompt), max_new_tokens, temperature, seed)
        finally:
            del model
            if str(device).startswith("cuda"):
                import torch
                torch.cuda.empty_cache()  # the float64 weights go back for the engine's run

    def golden_for(self, prompt, config: DecodeConfig, device: str | None = None) -> GoldenRun:
        """The golden run a decode with ``config`` compares against (and an oracle drafter follows): checks the
        prompt and ``config`` against the model first, so a bad argument never waits for it. DDTree reaches
        block_size tokens further, covering the last step's overshoot. ``device`` as for ``golden``."""
        run = config.resolved(self.cfg.vocab_size)
        ids = check_prompt(self.cfg, self.encode_prompt(prompt), run.max_new_tokens)
        reach = min(run.max_new_tokens + run.block_size, self.cfg.max_position_embeddings - len(ids))
        return self.golden(ids, reach if run.mode == "ddtree" else run.max_new_tokens, run.temperature, run.seed,
                           device)

    def make_drafter(self, prompt_ids, config: DecodeConfig, golden: Optional[GoldenRun] = None):
        """The drafter ``config.drafter`` names for a run of ``prompt_ids`` (None: an AR run, or none named): the
        trained block drafter, or an oracle following ``golden`` (which it then needs). Raises DrafterError
        (a ValueError) when a trained drafter cannot be loaded."""
        if config.mode == "ar" or config.drafter is None:
            return None
        spec = parse_drafter(config.drafter)
        resolved = config.resolved(self.cfg.vocab_size)
        if spec.kind == "dflash":
            return self.block_drafter(spec.path, resolved.topk)
        if golden is None:
            raise ValueError(f"drafter {config.drafter} follows the golden run: give it one")
        return spec.build(np.concatenate([np.asarray(prompt_ids, dtype=np.int64), golden.tokens]),
                          resolved.num_depths, resolved.topk, self.cfg.vocab_size, config.seed)

    def block_drafter(self, directory: Optional[str], top_k: int) -> BlockDrafter:
        """The trained block drafter in ``directory`` (None: ``drafter/`` beside the model) for this target: on
        the sim and cuda backends its forward runs on the device (engine/device/drafter.py; DrafterError when
        its attention widths exceed the kernels' there), on the reference backend the float64 golden's."""
        if directory is None:
            home = model_directory(self.source)
            if home is None:
                raise DrafterError(f"model {self.source!r} has no directory, so no drafter beside it: "
                                   f"use dflash:DIR")
            directory = home / DRAFTER_DIR
        cfg, weights, digest = load_drafter(directory)
        cfg.check_target(self.cfg)
        lm_head = self.weights["model.embed_tokens.weight" if self.cfg.tie_word_embeddings else "lm_head.weight"]
        device = None
        if self.backend in ("sim", "cuda"):
            from kdspec.engine.device.drafter import DeviceDrafter
            device = DeviceDrafter(cfg, weights, self.model, top_k)
        return BlockDrafter(cfg, weights, self.weights["model.embed_tokens.weight"], lm_head, top_k, self.model,
                            name=f"dflash:{directory}", digest=digest, device=device)

    def generate(self, prompt, config: DecodeConfig, *, drafter=None, golden: Union[None, bool, GoldenRun] = None,
                 on_step: Optional[Callable[[dict], None]] = None) -> GenerateResult:
        """Decode ``prompt`` (text or token ids) with the settings ``config`` (engine.decode.loop.generate).

        drafter: a Drafter object for mode "ddtree"; None builds ``config.drafter`` ("oracle" / "noisy:P") over
        the golden run at the same temperature and seed.
        golden: a GoldenRun, True (compute it), False (never), None (use it when the drafter needed one).
        The result's ``meta`` gains backend, model, drafter and the golden run (key "golden").
        """
        ids = self.encode_prompt(prompt)
        spec = None if drafter is not None or config.drafter is None else parse_drafter(config.drafter)
        run = golden if isinstance(golden, GoldenRun) else None
        if run is None and (golden is True or (spec is not None and spec.needs_golden)):
            run = self.golden_for(ids, config)
        if spec is not None:
            drafter = self.make_drafter(ids, config, run)
        golden = None if golden is False else run
        result = generate(self.model, ids, config, drafter, golden=golden, on_step=on_step, tree_ops=self.tree_ops)
        name = config.drafter or (None if drafter is None else type(drafter).__name__)
        result.meta.update(backend=self.backend, model=self.source, drafter=name, golden=golden)
        return result


def load(model: Union[str, Path] = "tiny", backend: str = "reference", seed: int = 0,
         weight_dtype: str = "float32") -> Engine:
    """A preset name (seeded random weights) or an HF checkpoint directory -> Engine on ``backend``.

    "auto" takes the best backend available: cuda (a GPU with torch), else sim (when the CUDA simulator is on),
    else reference. ``weight_dtype`` "bfloat16" stores the device model's weights in bf16 (fp32 arithmetic).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
    if weight_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"weight_dtype must be one of {', '.join(WEIGHT_DTYPES)}, got {weight_dtype!r}")
    cfg, weights = load_model(model, seed)
    candidates = ("cuda", "sim", "reference") if backend == "auto" else (backend,)
    for name in candidates:
        try:
            device_model = (ReferenceModel(cfg, weights) if name == "reference"
                            else _device_model(name, cfg, weights, weight_dtype))
        except BackendUnavailable:
            if name == candidates[-1]:
                raise
            continue
        return Engine(cfg, weights, name, device_model, seed, str(model), weight_dtype)
    raise AssertionError("unreachable")
