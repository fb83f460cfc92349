"""``kdtree train target``: train the shipped DeepSeek-V3-architecture target and write its model directory.

The directory holds what transformers' ``save_pretrained`` writes (config.json, model.safetensors in bf16 with
the router biases in fp32, generation_config.json), tokenizer.json, manifest.json (recipe, corpus, loss curve,
held-out bits/byte next to gzip / xz measured in the same run, expert load, greedy samples, versions) and
train.log (the progress lines). Bad input (an empty corpus directory, a bad vocabulary size, an output
directory that exists without --force) prints one line on stderr and exits 2.

    PYTHONPATH=$PWD python3 -m engine.train.target --corpus .train_data --out OUT_DIR --time-budget 240
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Optional

from . import corpus as corpus_mod
from .baselines import measure_baselines
from .corpus import HELDOUT
from .errors import TrainError
from .outputs import check_output_dir, replace_output_dir
from .prepare import DATA_MANIFEST, PreparedData, default_stdlib, file_sha256, resolve_data
from .recipe import OPTIMS, SHAPES, with_vocab
from .tokenizer import EOD_ID, check_vocab_size
from .windows import eval_windows

LOG_FILE = "train.log"
MANIFEST_FILE = "manifest.json"
EVALUATION = ("every token of every held-out file and each file's closing EOD predicted once; each file "
              "(opened by EOD) cut into non-overlapping windows of `context` tokens from its start, windows never "
              "cross files; bf16-rounded weights, fp32 compute")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--corpus", default=str(default_stdlib()),
                        help="a prepared data directory (python -m engine.train.prepare), its corpus.jsonl.xz, a "
                             "corpus file, or a Python stdlib directory (default: this Python's stdlib)")
    parser.add_argument("--out", required=True, help="model directory to write")
    parser.add_argument("--force", action="store_true",
                        help="replace an existing output directory (only what an earlier run wrote)")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="BPE vocabulary size (default: the prepared data's, else 4096)")
    parser.add_argument("--time-budget", type=float, default=240.0,
                        help="seconds of training steps and periodic evaluation (setup and the final "
                             "evaluation come on top)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto", help="torch device (default: cuda when available, else cpu)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="pycoder-mini",
                        help="model shape and optimisation preset (smoke: a tiny CPU test)")
    parser.add_argument("--max-steps", type=int, default=None, help="stop after this many steps")
    parser.add_argument("--experts-implementation", choices=("eager", "grouped_mm", "batched_mm"), default=None,
                        help="transformers' MoE experts kernel (default: transformers' choice)")


# What --force may replace: the files a run writes (the model by transformers' save_pretrained, the tokenizer,
# manifest and log) and heldout_prompts.json (tools/pycoder_prompts.py); a drafter/ inside is refused.
OUTPUT_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", MANIFEST_FILE,
                LOG_FILE, "heldout_prompts.json")


def _prepare_out_dir(out: Path, force: bool) -> None:
    replace_output_dir(out, force, OUTPUT_FILES)


def _run_baselines(data: PreparedData, log) -> dict:
    """gzip / xz on the raw held-out text of the corpus file, in this run; the data directory's as recorded."""
    recorded = data.baselines
    if not data.corpus_path.is_file():
        log(f"{data.corpus_path}: no corpus file, baselines only as the data directory recorded them")
        return {"this_run": None, "data_dir": recorded}
    files, manifest = corpus_mod.read_corpus(data.corpus_path)
    if asdict(manifest.heldout) != data.manifest["corpus"][HELDOUT]:
        raise TrainError(f"{data.corpus_path}: held-out split differs from the data manifest's")
    measured = measure_baselines([f.data for f in corpus_mod.split_files(files, HELDOUT)])
    return {"this_run": measured, "data_dir": recorded}


def _torch_device(name: str):
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise TrainError(f"--device {name!r} is not a torch device ({e})") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise TrainError(f"--device {name}: CUDA is not available")
    return device


def _device_name(device) -> str:
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


def _bias_summary(biases: list[list[float]]) -> dict:
    flat = [abs(b) for layer in biases for b in layer]
    return {"values": biases, "abs_max": max(flat), "abs_mean": sum(flat) / len(flat)}


def _output_files(out: Path) -> list[dict]:
    """The model directory's files but the manifest and the log (still being written)."""
    return [{"file": p.name, "bytes": p.stat().st_size, "sha256": file_sha256(p)} for p in sorted(out.iterdir())
            if p.is_file() and p.name not in (MANIFEST_FILE, LOG_FILE)]


def run(args: argparse.Namespace) -> int:
    """Train and write ``args.out``; raises TrainError on bad input."""
    wall_start = time.perf_counter()
    if args.vocab_size is not None:
        check_vocab_size(args.vocab_size)
    if not args.time_budget > 0:
        raise TrainError(f"--time-budget must be positive seconds, got {args.time_budget}")
    if args.max_steps is not None and args.max_steps < 1:
        raise TrainError(f"--max-steps must be positive, got {args.max_steps}")
    corpus_path, out = Path(args.corpus), Path(args.out)
    if not corpus_path.exists():
        raise TrainError(f"{corpus_path}: no such corpus directory or file")
    if corpus_path.is_dir() and not any(corpus_path.iterdir()):
        raise TrainError(f"{corpus_path}: corpus directory is empty")
    # a source tree (not a prepared data directory) without Python files: say so before asking for torch
    if corpus_path.is_dir() and not (corpus_path / DATA_MANIFEST).exists() \
            and next(corpus_path.rglob("*.py"), None) is None:
        raise TrainError(f"{corpus_path}: no .py file under the corpus directory")
    check_output_dir(out, args.force, OUTPUT_FILES)   # before the data and torch: a refusal costs nothing

    missing = [name for name in ("torch", "transformers") if importlib.util.find_spec(name) is None]
    if missing:
        raise TrainError(f"training needs {' and '.join(missing)} (pip install torch transformers)")
    device = _torch_device(args.device)

    with tempfile.TemporaryDirectory(prefix="kdtree-train-") as scratch:
        data = resolve_data(corpus_path, args.vocab_size, Path(scratch) / "data", log=print)
        _prepare_out_dir(out, args.force)
        log_file = open(out / LOG_FILE, "a", encoding="utf-8")

        def log(line: str) -> None:
            print(line, flush=True)
            log_file.write(line + "\n")
            log_file.flush()

        try:
            return _train_and_save(args, device, data, out, log, wall_start)
        finally:
            log_file.close()


def _versions() -> dict:
    import torch
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}


def _log_setup(log, device, shape, data: PreparedData, reference: dict, versions: dict) -> None:
    """The run's first lines: device, versions, sizes, then the baselines to beat."""
    log(f"device {_device_name(device)}; torch {versions['torch']}, transformers {versions['transformers']}; "
        f"{shape.parameter_count()} parameters; vocab {data.vocab_size}; train {len(data.train)} tokens, "
        f"held-out {len(data.heldout)} tokens / {data.heldout_raw_bytes} bytes")
    log(f"held-out baselines (bits/byte): gzip per file {reference['gzip_per_file']:.4f}, xz per file "
        f"{reference['xz_per_file']:.4f}, xz whole {reference['xz_whole']:.4f}")


def _save_model(model, data: PreparedData, out: Path) -> None:
    """save_pretrained of a bf16 copy (router biases fp32), and the tokenizer beside it."""
    from .trainer import bf16_copy

    saved = bf16_copy(model)
    saved.save_pretrained(out, safe_serialization=True)
    del saved
    shutil.copyfile(data.tokenizer_path, out / data.tokenizer_path.name)


def _recipe(args, shape, optim, device, model_config) -> dict:
    return {"shape": asdict(shape), "optim": asdict(optim), "seed": args.seed,
            "time_budget_s": args.time_budget, "max_steps": args.max_steps, "device": str(device),
            "attn_implementation": model_config._attn_implementation,
            "experts_implementation": getattr(model_config, "_experts_implementation", None),
            "saved_dtype": "bfloat16 (mlp.gate.e_score_correction_bias float32)"}


def _heldout(result, data: PreparedData, reference: dict, bits: float) -> dict:
    """The saved weights' held-out score, and its distance to the baselines."""
    return {"bits_per_byte": bits, "loss_nats_per_token": result.final.loss,
            "predictions": result.final.predictions, "raw_bytes": data.heldout_raw_bytes,
            "evaluation": EVALUATION, "best_step": result.best_step,
            "best_loss_during_training_bf16_autocast": result.best_heldout_loss,
            "minus_gzip_per_file": bits - reference["gzip_per_file"],
            "minus_xz_per_file": bits - reference["xz_per_file"],
            "minus_xz_whole": bits - reference["xz_whole"]}


def _manifest(args, device, data: PreparedData, shape, optim, result, baselines: dict, versions: dict) -> dict:
    """manifest.json but its samples (filled in later), wall_seconds and files (at each write)."""
    from .balance import load_spread

    reference = baselines["this_run"] or baselines["data_dir"]
    bits = result.final.bits_per_byte(data.heldout_raw_bytes)
    return {
        "model": args.shape,
        "architecture": "DeepseekV3ForCausalLM (transformers)",
        "recipe": _recipe(args, shape, optim, device, result.model.config),
        "corpus": data.manifest["corpus"],
        "data": {"corpus_file": data.manifest["corpus_file"], "streams": data.manifest["streams"],
                 "tokenizer": data.manifest["tokenizer"]},
        "tokenizer": {"vocab_size": data.vocab_size, "eod_id": EOD_ID, "eod": "<|endoftext|>",
                      "file": data.tokenizer_path.name},
        "parameters": result.parameters,
        "loss_curve": result.curve,
        "loss_curve_fields": "train_loss: mean cross-entropy (nats/token) of the steps since the previous "
                             "evaluation, dropout on, bf16 autocast; heldout_loss: nats/token over the whole "
                             "held-out split, bf16 autocast; heldout_expert_cv: mean over MoE layers of "
                             "std/mean of per-expert held-out load; seconds: training clock",
        "heldout": _heldout(result, data, reference, bits),
        "baselines": baselines,
        "expert_load_heldout": load_spread(result.final.expert_counts),
        "e_score_correction_bias": _bias_summary(result.loads.biases()),
        "steps": result.steps, "tokens": result.tokens, "stop_reason": result.stop_reason,
        "train_seconds": result.train_seconds, "eval_seconds": result.eval_seconds,
        "tokens_per_s": result.tokens / max(result.train_seconds, 1e-9),
        "versions": versions,
        "device_name": _device_name(device),
        "samples": None,
    }


def _write_manifest(out: Path, manifest: dict, wall_start: float) -> None:
    manifest["wall_seconds"] = time.perf_counter() - wall_start
    manifest["files"] = _output_files(out)
    (out / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")


def _greedy_samples(model, data: PreparedData, optim, device, log) -> list[dict] | dict:
    """Greedy continuations of the data's sample prompts, logged; a failure is returned as {"error": ...}."""
    from .samples import greedy_continuations

    try:
        samples = greedy_continuations(model, data.manifest["sample_prompts"], optim.sample_new_tokens, EOD_ID,
                                       data.decoder(), device)
        for s in samples:
            log(f"--- {s['relpath']}:{s['line']}\n{s['prompt']}{s['continuation']}")
        return samples
    except Exception as e:  # noqa: BLE001 - recorded, the model directory is already complete
        log(f"greedy samples failed: {type(e).__name__}: {e}")
        return {"error": f"{type(e).__name__}: {e}"}


def _train_and_save(args, device, data: PreparedData, out: Path, log, wall_start: float) -> int:
    from .trainer import train

    shape = with_vocab(SHAPES[args.shape], data.vocab_size)
    optim = OPTIMS[args.shape]
    baselines = _run_baselines(data, log)
    reference = baselines["this_run"] or baselines["data_dir"]
    versions = _versions()
    _log_setup(log, device, shape, data, reference, versions)

    windows = eval_windows(data.heldout, optim.context)
    result = train(shape, optim, data.train, windows, data.heldout_raw_bytes, device, args.time_budget,
                   args.seed, max_steps=args.max_steps, experts_implementation=args.experts_implementation,
                   log=log)
    _save_model(result.model, data, out)
    manifest = _manifest(args, device, data, shape, optim, result, baselines, versions)
    _write_manifest(out, manifest, wall_start)  # a failure in sampling still leaves a complete model directory
    manifest["samples"] = _greedy_samples(result.model, data, optim, device, log)
    bits = manifest["heldout"]["bits_per_byte"]
    log(f"held-out {bits:.4f} bits/byte vs gzip per file {reference['gzip_per_file']:.4f}, xz per file "
        f"{reference['xz_per_file']:.4f}, xz whole {reference['xz_whole']:.4f}; wrote {out}")
    _write_manifest(out, manifest, wall_start)
    log(f"wall {manifest['wall_seconds']:.1f} s")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="kdtree train target", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except TrainError as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
