"""``python -m kdspec.engine.train.drafter_train``: train the kdtree-dflash block drafter of a target directory.

The target (a transformers DeepseekV3ForCausalLM directory, default the shipped pycoder-mini) is frozen. Data
(drafter_data.py): its own greedy continuations of random training-stream windows, labelled by its fp32
argmax; the held-out stream gives the validation and evaluation sequences only (never trained on). Training:
AdamW, linear warmup then cosine over the time budget, bf16 autocast, loss = cross-entropy at each drafted depth j
weighted by exp(-(j - 1) / gamma) / sum; the best state by validation tau is kept and a softmax temperature
fitted on validation is folded into norm.weight (drafter_loop.py). The output directory (``--out``) gets
config.json (engine/model/drafter.py), model.safetensors (bf16), manifest.json (recipe, data and target digests, loss
curve, held-out metrics next to bigram baselines measured in the same run, versions, device) and train.log. Bad
input prints one line on stderr and exits 2.

    kdtree train drafter --model engine/model/presets/pycoder-mini --data .train_data --out OUT/drafter
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from kdspec.engine.model.config import shipped_model_dir
from kdspec.engine.model.drafter import CONFIG_FILE, MANIFEST_FILE, WEIGHTS_FILE, DrafterConfig, DrafterError

from .drafter_config import default_target_layers
from .errors import TrainError
from .outputs import check_output_dir, replace_output_dir
from .prepare import file_sha256, load_prepared

LOG_FILE = "train.log"
OUTPUT_FILES = (CONFIG_FILE, WEIGHTS_FILE, MANIFEST_FILE, LOG_FILE)   # what --force may replace
LABELS = ("labels = the target's fp32 greedy chain: each sequence = a random window of the split's token stream "
          "(prompt) + the target's greedy continuation generated with its KV cache under bf16 autocast; then one "
          "fp32 forward (no autocast, full-precision matmuls) over the whole sequence gives the tapped hidden "
          "states and the argmax per row; an anchor P is used only when the tokens at P..P+L equal the fp32 "
          "argmax of the row before each (so bonus and labels are exactly the fp32 target's greedy chain)")


@dataclass(frozen=True)
class Recipe:
    """Data, optimisation and evaluation settings (all recorded in the manifest)."""

    train_sequences: int = 15744
    val_sequences: int = 128
    heldout_sequences: int = 512
    new_tokens: int = 256
    prompt_min: int = 64
    prompt_max: int = 256
    gen_batch: int = 8192
    data_budget_s: float = 60.0
    batch_sequences: int = 64
    anchors_per_sequence: int = 128
    lr: float = 2e-3
    min_lr_ratio: float = 0.05
    warmup_steps: int = 200
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    gamma: float = 4.0
    eval_interval_s: float = 15.0
    patience: int = 5
    eval_anchors_per_sequence: int = 64
    tree_blocks: int = 2048


def add_arguments(parser: argparse.ArgumentParser) -> None:
    default = Recipe()
    parser.add_argument("--model", "--target", dest="target", metavar="DIR",
                        default=str(shipped_model_dir("pycoder-mini")),
                        help="the target's model directory (default: the shipped pycoder-mini)")
    parser.add_argument("--data", default=".train_data", help="prepared data directory (engine/train/prepare.py)")
    parser.add_argument("--out", required=True, help="drafter directory to write")
    parser.add_argument("--force", action="store_true",
                        help="replace an existing output directory (only what an earlier run wrote)")
    parser.add_argument("--time-budget", type=float, default=240.0,
                        help="seconds of training steps and periodic held-out checks (data generation and the "
                             "final evaluation come on top)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto", help="torch device (default: cuda when available, else cpu)")
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--gamma", type=float, default=default.gamma, help="depth weight exp(-(j-1)/gamma)")
    parser.add_argument("--block-size", type=int, default=8, help="bonus + drafted depths")
    parser.add_argument("--target-layers", default=None,
                        help="comma-separated target hidden-state indices (default: 2,4,5 for a 5-layer target)")
    parser.add_argument("--max-steps", type=int, default=None, help="stop after this many steps")
    parser.add_argument("--lr", type=float, default=default.lr)
    parser.add_argument("--data-budget-s", type=float, default=default.data_budget_s,
                        help="seconds of training-data generation: no new generation batch starts after them")
    for name in ("train_sequences", "val_sequences", "heldout_sequences", "new_tokens", "prompt_min", "prompt_max",
                 "gen_batch", "batch_sequences", "anchors_per_sequence", "eval_anchors_per_sequence", "tree_blocks",
                 "patience"):
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(default, name))


def _recipe(args) -> Recipe:
    fields = {k: getattr(args, k) for k in Recipe.__dataclass_fields__ if hasattr(args, k)}
    recipe = Recipe(**fields)
    for name in ("train_sequences", "val_sequences", "heldout_sequences", "new_tokens", "prompt_min", "gen_batch",
                 "batch_sequences", "anchors_per_sequence", "eval_anchors_per_sequence", "patience"):
        if getattr(recipe, name) < 1:
            raise TrainError(f"--{name.replace('_', '-')} must be positive, got {getattr(recipe, name)}")
    if recipe.prompt_max < recipe.prompt_min:
        raise TrainError(f"--prompt-max {recipe.prompt_max} is below --prompt-min {recipe.prompt_min}")
    if not recipe.gamma > 0 or not recipe.lr > 0:
        raise TrainError(f"--gamma and --lr must be positive, got {recipe.gamma} and {recipe.lr}")
    return recipe


def _target_layers(text: Optional[str], num_hidden_layers: int) -> tuple[int, ...]:
    if text is None:
        return default_target_layers(num_hidden_layers)
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise TrainError(f"--target-layers must be comma-separated integers, got {text!r}") from None


def _read_target_config(target: Path) -> dict:
    if not target.is_dir():
        raise TrainError(f"{target}: no such target model directory")
    for name in ("config.json", "model.safetensors"):
        if not (target / name).is_file():
            raise TrainError(f"{target}: target model directory lacks {name}")
    try:
        config = json.loads((target / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise TrainError(f"{target / 'config.json'}: not JSON ({e})") from None
    for key in ("hidden_size", "num_hidden_layers", "vocab_size"):
        if not isinstance(config.get(key), int):
            raise TrainError(f"{target / 'config.json'}: missing integer {key}")
    return config


def run(args: argparse.Namespace) -> int:
    """Validate, train and write ``args.out``; raises TrainError on bad input."""
    wall_start = time.perf_counter()
    target, out = Path(args.target), Path(args.out)
    _check_run_arguments(args)
    target_config = _read_target_config(target)
    recipe = _recipe(args)
    cfg = _drafter_config(args, target, target_config)
    check_output_dir(out, args.force, OUTPUT_FILES)
    data = _load_data(args.data, target, target_config)
    _require_torch()
    from .target import _device_name, _torch_device

    device = _torch_device(args.device)
    replace_output_dir(out, args.force, OUTPUT_FILES)
    with open(out / LOG_FILE, "a", encoding="utf-8") as log_file:
        log = _tee(log_file)
        from .drafter_loop import train_and_evaluate

        result = train_and_evaluate(cfg, recipe, target, data, device, args.time_budget, args.seed,
                                    args.max_steps, log)
        result.save(out)
        manifest = _manifest(args, cfg, result, target, target_config, data, device, _device_name(device))
        manifest["wall_seconds"] = time.perf_counter() - wall_start
        _write_manifest(out, manifest)
        log(f"wrote {out} ({(out / WEIGHTS_FILE).stat().st_size:,} B weights); wall {manifest['wall_seconds']:.1f} s")
    return 0


def _check_run_arguments(args: argparse.Namespace) -> None:
    """The command-line settings that are not part of the recipe."""
    if args.block_size < 2:
        raise TrainError(f"--block-size must be >= 2 (bonus + at least one drafted depth), got {args.block_size}")
    if not args.time_budget > 0:
        raise TrainError(f"--time-budget must be positive seconds, got {args.time_budget}")
    if args.max_steps is not None and args.max_steps < 1:
        raise TrainError(f"--max-steps must be positive, got {args.max_steps}")


def _drafter_config(args: argparse.Namespace, target: Path, target_config: dict) -> DrafterConfig:
    return DrafterConfig(
        hidden_size=target_config["hidden_size"], num_layers=args.num_layers, block_size=args.block_size,
        target_layers=_target_layers(args.target_layers, target_config["num_hidden_layers"]),
        rms_norm_eps=float(target_config.get("rms_norm_eps", 1e-6)),
        target={"name": target.resolve().name, "model_safetensors_sha256": file_sha256(target / "model.safetensors"),
                "vocab_size": target_config["vocab_size"], "num_hidden_layers": target_config["num_hidden_layers"]})


def _load_data(data_dir: str, target: Path, target_config: dict):
    """The prepared data, whose vocabulary must be the target's, and its tokenizer too where the target ships one
    (the same vocabulary size from another corpus or BPE fit would train the drafter on other token ids)."""
    data = load_prepared(data_dir)
    if data.vocab_size != target_config["vocab_size"]:
        raise TrainError(f"{data_dir}: vocabulary {data.vocab_size} differs from the target's "
                         f"{target_config['vocab_size']}")
    target_tokenizer = target / data.tokenizer_path.name
    if target_tokenizer.is_file() and file_sha256(target_tokenizer) != file_sha256(data.tokenizer_path):
        raise TrainError(f"{data_dir}: {data.tokenizer_path.name} differs from the target's {target_tokenizer} "
                         f"(data prepared from another corpus or fit?)")
    return data


def _require_torch() -> None:
    missing = [name for name in ("torch", "transformers") if importlib.util.find_spec(name) is None]
    if missing:
        raise TrainError(f"drafter training needs {' and '.join(missing)} (pip install torch transformers)")


def _tee(log_file) -> Callable[[str], None]:
    """A log function that prints each line and appends it to ``log_file`` (flushed)."""
    def log(line: str) -> None:
        print(line, flush=True)
        log_file.write(line + "\n")
        log_file.flush()
    return log


def _manifest(args: argparse.Namespace, cfg: DrafterConfig, result, target: Path, target_config: dict, data,
              device, device_name: str) -> dict:
    """manifest.json less its wall_seconds and files (run and _write_manifest add them)."""
    streams = data.manifest["streams"]
    return {
        "drafter": cfg.to_dict(),
        "parameters": cfg.parameter_count(),
        "recipe": {**result.recipe_dict(), "seed": args.seed, "time_budget_s": args.time_budget,
                   "max_steps": args.max_steps, "device": str(device), "labels": LABELS,
                   "saved_dtype": "bfloat16 (every tensor)"},
        "target": {**cfg.target, "dir": str(target), "config": target_config},
        "data": {"dir": str(args.data), "streams_used": {s: streams[s] for s in ("train", "heldout")},
                 "train_stream_sha256": streams["train"]["sha256"],
                 "heldout_stream_sha256": streams["heldout"]["sha256"],
                 "heldout_use": "evaluation only (held-out prompts); never trained on",
                 "generated": result.data_summary},
        **result.manifest_fields(),
        "versions": result.versions,
        "device_name": device_name,
    }


def _write_manifest(out: Path, manifest: dict) -> None:
    """Add the digests of the written config and weights to ``manifest`` and write it to ``out``."""
    manifest["files"] = [{"file": p.name, "bytes": p.stat().st_size, "sha256": file_sha256(p)}
                         for p in sorted(out.iterdir()) if p.name in (CONFIG_FILE, WEIGHTS_FILE)]
    (out / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="kdtree train drafter", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except (TrainError, DrafterError) as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
