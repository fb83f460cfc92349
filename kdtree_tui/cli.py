"""The `kdtree` command line: the one place that joins engine, traces and app.

The engine (and so numba) is imported lazily inside the commands that need it, so that `kdtree tui`
starts fast and works where numba is absent. Errors the user can fix print one line and exit 2.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import signal
import shutil
import sys
import tempfile
import time
import warnings


# --save-logits stores [steps, L+1, V] floats: only for small vocabularies.
MAX_SAVED_VOCAB = 4096
# Exit status when stdout is a closed pipe (`kdtree info --json T | head`): a shell's for a SIGPIPE kill.
BROKEN_PIPE_EXIT = 141
# numba-cuda's occupancy warning, after the highlighting codes it may start with
LOW_OCCUPANCY_HINT = r".*Grid size \d+ will likely result in GPU under-utilization"


class UsageError(Exception):
    """Bad input from the user: printed as one line, exit status 2."""


class DefaultsFormatter(argparse.HelpFormatter):
    """--help states every option's default: "(default: X)" after its help, unless the help says it already;
    flags read "(default: off)"; an option without help text still gets its default."""

    def _format_action(self, action: argparse.Action) -> str:
        if action.option_strings and action.help is None:
            action = copy.copy(action)
            action.help = self.NO_HELP   # argparse formats no help at all, and so no default, without it
        return super()._format_action(action)

    NO_HELP = "\0"

    def _get_help_string(self, action: argparse.Action) -> str:
        text = "" if action.help == self.NO_HELP else action.help or ""
        if not action.option_strings or "default" in text or action.default is argparse.SUPPRESS:
            return text
        if action.required:
            return f"{text} (required)".strip()
        if action.nargs == 0:   # store_true / store_false
            return f"{text} (default: {'on' if action.default else 'off'})".strip()
        if action.default is None:
            return f"{text} (default: none)".strip()
        return f"{text} (default: %(default)s)".strip()


class OneLineParser(argparse.ArgumentParser):
    """argparse, with a usage error as one line (the usage itself is what --help shows) and every default in
    --help."""

    def __init__(self, *args, formatter_class=DefaultsFormatter, **kwargs):
        super().__init__(*args, formatter_class=formatter_class, **kwargs)

    def error(self, message: str):
        _error_line(f"{self.prog}: error: {message} (see {self.prog} --help)")
        sys.exit(2)


class Terminated(KeyboardInterrupt):
    """SIGTERM during a recording, raised like Ctrl-C so that the trace is closed "interrupted" (exit 143)."""


@contextlib.contextmanager
def _sigterm_interrupts():
    """While recording, SIGTERM raises Terminated in the main thread (Python's default would kill the process
    with the trace left "recording")."""
    def interrupt(signum, frame):
        raise Terminated()
    try:
        previous = signal.signal(signal.SIGTERM, interrupt)
    except ValueError:  # not the main thread: leave the default
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _cmd_config(args: argparse.Namespace) -> int:
    from kdspec.engine.model.config import ConfigError, resolve_config

    try:
        cfg = resolve_config(args.model)
    except ConfigError as e:
        raise UsageError(str(e)) from None
    print(json.dumps(cfg.to_hf_dict(), indent=2))
    return 0


def _select_backend(name: str) -> str:
    """Before numba is imported: "auto" without a visible GPU turns the CUDA simulator on (docs/architecture.md: the best
    backend available is a GPU, else the simulator); "sim" always does."""
    if name == "sim" or (name == "auto" and not _gpu_visible()):
        os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
    return name


def _gpu_visible() -> bool:
    return os.path.exists("/dev/nvidiactl") or shutil.which("nvidia-smi") is not None


def _parse_prompt(args: argparse.Namespace) -> list[int]:
    """--prompt-ids as given, or --prompt encoded with the model's tokenizer (its tokenizer.json, else bytes)."""
    if args.prompt_ids is not None:
        try:
            ids = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
        except ValueError:
            raise UsageError(f"--prompt-ids must be comma-separated integers, got {args.prompt_ids!r}") from None
        return ids
    from kdspec.engine.model.checkpoint import CheckpointError, model_tokenizer
    from kdspec.engine.model.config import ConfigError
    try:
        return model_tokenizer(args.model).encode(args.prompt)
    except (CheckpointError, ConfigError, ValueError) as e:
        raise UsageError(str(e)) from None


GOLDEN_HELP = ("where the float64 golden runs: cpu (numpy), gpu (the same math in torch float64 on the GPU: needs "
               "torch with CUDA), none (no comparison; the oracle drafters follow the golden, so they need one); auto: "
               "gpu for a run on cuda whose float64 weights (8 bytes a parameter) fit the free GPU memory, else cpu "
               "while they take at most half the RAM, else none")


def record_trace(model: str, out: str, prompt_ids: list[int], config, *, backend: str = "auto",
                 weight_dtype: str = "float32", force: bool = False, progress=None, golden: str = "auto") -> dict:
    """Load the model, run the golden (``golden``: auto | cpu | gpu | none) and the engine with ``config``
    (engine.decode.config.DecodeConfig) and write every step to ``out``; returns a summary dict. ``progress``:
    a terminal stream for the progress line (None: quiet). Raises UsageError for anything the user can fix."""
    from kdspec.kdtree_tui.progress import Progress
    from kdspec.traces import TraceError
    from kdspec.traces.lock import OutputLock
    from kdspec.traces.writer import check_output

    _check_golden_choice(golden, config)  # before any file is touched
    if os.path.exists(out) and not force:
        raise UsageError(f"{out} exists (pass --force to overwrite it)")
    try:  # before the model loads: a second recorder of ``out`` is told at once
        check_output(out, force)
        lock = OutputLock(out)
    except TraceError as e:
        raise UsageError(str(e)) from None
    bar = Progress(progress)
    try:
        with _sigterm_interrupts():
            engine, run, where, seconds = _load_with_golden(model, prompt_ids, config, backend, weight_dtype, golden,
                                                            bar)
            drafter = _make_drafter(engine, prompt_ids, config, run)   # before the output is touched
            writer = _open_writer(out, engine, model, prompt_ids, config, force, lock, where, drafter, seconds)
            result = _decode_into(writer, engine, prompt_ids, config, run, bar, drafter)
    finally:
        lock.release()  # the writer gave it back already, unless it was never opened
    return dict(out=out, backend=engine.backend, device=_device_name(engine.backend), steps=result.steps,
                mean_tau=result.mean_tau, golden_match=result.golden_match, tokens=len(result.tokens),
                elapsed=result.elapsed, golden=where, golden_seconds=seconds)


def _check_golden_choice(golden: str, config) -> None:
    """What --golden refuses before anything loads: an unknown choice, none with a drafter that follows the
    golden, gpu where torch has no CUDA GPU."""
    from kdspec.engine.decode import api

    if golden not in api.GOLDENS:
        raise UsageError(f"--golden must be one of {', '.join(api.GOLDENS)}, got {golden!r}")
    if golden == "none":
        _refuse_oracle_without_golden(config, "--golden none leaves it out")
    if golden == "gpu":
        missing = api.gpu_golden_unavailable()
        if missing:
            raise UsageError(f"--golden gpu: {missing} (use --golden cpu or none)")


def _refuse_oracle_without_golden(config, why: str) -> None:
    from kdspec.engine.decode.drafters import parse_drafter

    if config.drafter is not None and parse_drafter(config.drafter).needs_golden:
        raise UsageError(f"drafter {config.drafter} (mode ddtree's default is oracle) follows the golden run, but "
                         f"{why}: pass --golden cpu or gpu, a trained drafter (--drafter dflash) or --mode ar")


def _load_with_golden(model: str, prompt_ids: list[int], config, backend: str, weight_dtype: str, golden: str,
                      bar):
    """(engine, golden run or None, where it ran: cpu | gpu | none, its seconds or None): the model loaded, the
    prompt and ``config`` checked against it, then the golden where ``golden`` (Engine.plan_golden) says."""
    from kdspec.engine.decode import api
    from kdspec.engine.decode.loop import check_prompt
    from kdspec.engine.model.checkpoint import CheckpointError
    from kdspec.engine.model.config import ConfigError

    try:
        with bar.phase(f"loading {model}" + ("" if backend == "auto" else f" ({backend} backend)")):
            engine = api.load(model, backend=backend, seed=config.seed, weight_dtype=weight_dtype)
        if config.record_logits and engine.cfg.vocab_size > MAX_SAVED_VOCAB:
            raise UsageError(f"--save-logits stores full logits: only for vocabularies up to {MAX_SAVED_VOCAB} "
                             f"(this one has {engine.cfg.vocab_size})")
        resolved = config.resolved(engine.cfg.vocab_size)
        check_prompt(engine.cfg, engine.encode_prompt(prompt_ids), resolved.max_new_tokens)
        plan = engine.plan_golden(golden)
        if plan.where == "none":
            if golden == "auto":
                _refuse_oracle_without_golden(config, f"--golden auto leaves it out ({plan.reason})")
            return engine, None, "none", None
        started = time.perf_counter()
        with bar.phase(f"computing the golden ({plan.where}, float64)"), _gpu_memory_is_usage(plan.where):
            run = engine.golden_for(prompt_ids, config, device=plan.device)
        return engine, run, plan.where, time.perf_counter() - started
    except (ValueError, ConfigError, CheckpointError) as e:
        raise UsageError(str(e).splitlines()[0]) from None
    except api.BackendUnavailable as e:
        raise UsageError(str(e)) from None


@contextlib.contextmanager
def _gpu_memory_is_usage(where: str):
    """The GPU golden running out of GPU memory is one line (torch's OutOfMemoryError, a RuntimeError)."""
    try:
        yield
    except RuntimeError as e:
        if where == "gpu" and type(e).__name__ == "OutOfMemoryError":
            raise UsageError("the GPU golden ran out of GPU memory: use --golden cpu or none") from None
        raise


def _make_drafter(engine, prompt_ids: list[int], config, golden):
    """The run's drafter object (None for AR), built before the writer opens: a drafter that cannot load is one
    line and leaves the output untouched."""
    try:
        return engine.make_drafter(engine.encode_prompt(prompt_ids), config, golden)
    except ValueError as e:  # DrafterError included
        raise UsageError(str(e).splitlines()[0]) from None


def _open_writer(out: str, engine, model: str, prompt_ids: list[int], config, force: bool, lock=None,
                 golden: str | None = None, drafter=None, golden_seconds: float | None = None):
    """The trace writer of a run of ``config`` on ``engine``: its decode_config is the resolved config's dict and
    where the golden ran (key golden: cpu | gpu | none, when given); the drafter's name, configuration and digest
    and the golden's seconds go into the run metadata; a BPE model's vocabulary goes in, so that the viewer shows
    text without the tokenizer."""
    import math

    from kdspec.engine.decode.drafters import drafter_metadata
    from kdspec.engine.model.tokenizer import vocabulary_bytes
    from kdspec.traces import RunMetadata, TraceError, TraceWriter

    decode_config = config.resolved(engine.cfg.vocab_size).as_dict()
    run = RunMetadata(decode_config=decode_config if golden is None else {**decode_config, "golden": golden},
                      model_config={**engine.cfg.to_hf_dict(), "name": model, "weight_dtype": engine.weight_dtype},
                      backend=engine.backend, device=_device_name(engine.backend), prompt_tokens=prompt_ids,
                      versions=_versions(), tokenizer=engine.tokenizer.name,
                      vocabulary=None if engine.tokenizer.name == "byte" else
                      vocabulary_bytes(engine.tokenizer, engine.cfg.vocab_size),
                      drafter=drafter_metadata(drafter, config),
                      golden_seconds=math.nan if golden_seconds is None else golden_seconds)
    try:
        return TraceWriter(out, run, save_logits=config.record_logits, force=force, lock=lock)
    except TraceError as e:
        raise UsageError(str(e)) from None


def _decode_into(writer, engine, prompt_ids: list[int], config, golden, bar, drafter=None):
    """Decode, writing each step's record; finish the trace (status "failed" when the run fails). ``golden``:
    the golden run, or None (no comparison); ``bar``: the kdtree_tui.progress.Progress line; ``drafter``: the
    run's drafter (None: AR, or built from config.drafter by the engine)."""
    import numpy as np

    from kdspec.traces import TraceError

    bar.start(config.max_new_tokens, done=1)  # the prefill's token (not a step)

    def on_step(record: dict) -> None:
        writer.write_step(record)
        bar.step(len(record["committed_tokens"]))

    try:
        result = engine.generate(prompt_ids, config, drafter=drafter, golden=False if golden is None else golden,
                                 on_step=on_step)
        writer.finish(result.tokens, None if golden is None else np.asarray(golden.tokens)[:config.max_new_tokens])
    except TraceError as e:
        _close(writer, "failed")
        raise UsageError(str(e)) from None
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM (Terminated): every completed step stays
        _close(writer, "interrupted")
        raise
    except BaseException:
        _close(writer, "failed")
        raise
    finally:
        bar.close()
    return result


def _close(writer, status: str) -> None:
    """Close a writer after an error; a close that fails too (a full disk) must not hide the first error."""
    from kdspec.traces import TraceError
    try:
        writer.close(status=status)
    except TraceError:
        pass


def _versions() -> dict[str, str]:
    import numba

    versions = {"kdtree": _version(), "numba": numba.__version__}
    try:
        import numba_cuda  # noqa: F401
        versions["numba-cuda"] = getattr(numba_cuda, "__version__", "?")
    except ImportError:
        pass
    return versions


def _device_name(backend: str) -> str:
    if backend == "cuda":
        from numba import cuda
        name = cuda.get_current_device().name
        return name.decode() if isinstance(name, bytes) else str(name)
    return {"sim": "CUDA simulator (CPU)", "reference": "CPU (numpy float64)"}.get(backend, backend)


def _version() -> str:
    try:
        from importlib.metadata import version
        return version("kdspec")  # the distribution's name (the command is kdtree)
    except Exception:  # not installed as a distribution (running from a checkout)
        return "dev"


def _decode_config(args: argparse.Namespace):
    """The DecodeConfig of `kdtree record`'s flags (--drafter defaults to oracle in mode ddtree)."""
    from kdspec.engine.decode.config import DecodeConfig

    drafter = "oracle" if args.drafter is None and args.mode == "ddtree" else args.drafter
    try:
        return DecodeConfig(args.max_new_tokens, mode=args.mode, block_size=args.block_size, budget=args.budget,
                            topk=args.topk, drafter=drafter, temperature=args.temperature, seed=args.seed,
                            record_logits=args.save_logits)
    except ValueError as e:
        raise UsageError(str(e)) from None


def _terminal(stream):
    """``stream`` when it is a terminal (the progress line goes there), else None."""
    try:
        return stream if stream.isatty() else None
    except (AttributeError, ValueError):  # no isatty, or closed
        return None


def _cmd_record(args: argparse.Namespace) -> int:
    _select_backend(args.backend)
    summary = record_trace(args.model, args.out, _parse_prompt(args), _decode_config(args), backend=args.backend,
                           weight_dtype=args.weight_dtype, force=args.force, progress=_terminal(sys.stderr),
                           golden=args.golden)
    match = {True: "equal to the golden", False: "DIVERGES from the golden",
             None: "no golden (--golden none)"}[summary["golden_match"]]
    golden = "" if summary["golden_seconds"] is None else f", golden on {summary['golden']} {summary['golden_seconds']:.1f} s"
    print(f"recorded {summary['out']}: {summary['tokens']} tokens in {summary['steps']} steps on "
          f"{summary['backend']} ({summary['device']}), mean tau {summary['mean_tau']:.2f}, {match}, "
          f"{summary['elapsed']:.1f} s{golden}")
    return 0


def _open_trace(path: str):
    from kdspec.traces import TraceError, open_trace
    try:
        _probe(path)
        return open_trace(path)
    except TraceError as e:
        raise UsageError(str(e)) from None


def _probe(path: str) -> None:
    """A file whose headers hang or crash HDF5 is one line before this process reads it (traces.probe)."""
    from kdspec.traces import TraceError
    from kdspec.traces.probe import probe
    try:
        probe(path)
    except TraceError as e:
        raise UsageError(str(e)) from None


def _cmd_info(args: argparse.Namespace) -> int:
    from kdspec.traces import TraceError, info_json, info_text
    from kdspec.traces.analytics_report import load_bench_rows, step_report, trace_report
    from kdspec.traces.thresholds import thresholds_for
    overrides = _threshold_overrides(args)
    try:
        bench = load_bench_rows(args.bench) if args.bench else None
    except ValueError as e:
        raise UsageError(str(e)) from None
    with _open_trace(args.trace) as reader:
        try:
            if args.step is not None:
                print(step_report(reader, args.step, args.json))
                return 0
            thresholds = thresholds_for(reader.metadata, **overrides)
            text, data = trace_report(reader, bench)
            print(json.dumps({**info_json(reader, thresholds), "analytics": data}, indent=2) if args.json
                  else info_text(reader, thresholds) + "\n" + text)
        except IndexError as e:
            raise UsageError(str(e)) from None
        except TraceError as e:
            raise UsageError(str(e)) from None
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from kdspec.traces import TraceError
    from kdspec.traces.export import export
    if args.nodes and args.format == "perfetto":
        raise UsageError("--nodes is for the row formats (jsonl, csv); perfetto exports the stage timings")
    with _open_trace(args.trace) as reader:
        try:
            if args.out is None:  # a closed pipe (`| head`) ends the command quietly: main handles it
                export(reader, args.format, sys.stdout, nodes=args.nodes)
                return 0
            try:
                out = open(args.out, "w", newline="")
            except OSError as e:
                raise UsageError(f"{args.out}: cannot write ({e.strerror or e})") from None
            with out:
                count = export(reader, args.format, out, nodes=args.nodes)
        except TraceError as e:
            raise UsageError(str(e)) from None
    _error_line(f"kdtree export: {count} {'events' if args.format == 'perfetto' else 'rows'} -> {args.out}")
    return 0


def _cmd_check(args: argparse.Namespace) -> int:
    from kdspec.traces import TraceError, check
    with _open_trace(args.trace) as reader:
        try:
            code, message = check(reader)
        except TraceError as e:
            raise UsageError(str(e)) from None
    print(f"{args.trace}: {message}")
    return code


def wait_for_first_step(path: str, poll: float = 0.2) -> None:
    """--follow of a recording that has not put its first step in place yet (the trace appears at its path
    then; docs/trace-format.md): wait for it, saying so once on stderr."""
    from kdspec.traces.lock import recording_state

    if recording_state(path) != "starting":
        return
    _error_line(f"kdtree tui: waiting for the recording of {path} to write its first step (Ctrl-C stops)")
    while recording_state(path) == "starting":
        time.sleep(poll)


def _cmd_tui(args: argparse.Namespace) -> int:
    from kdspec.kdtree_tui.app import run_app
    if args.follow:
        wait_for_first_step(args.trace)
    for path in (args.trace, args.compare):
        if path is not None and not os.path.exists(path):
            raise UsageError(f"{path}: no such file")
        if path is not None:
            _probe(path)
    overrides = _threshold_overrides(args)
    return run_app(args.trace, compare=args.compare, follow=args.follow, threshold_overrides=overrides)


def _add_threshold_options(p: argparse.ArgumentParser) -> None:
    from kdspec.traces.thresholds import DEFAULT_MIN_TAU
    by_precision = "default: by the trace's precision, float64 / fp32 / bf16 weights; `kdtree info` shows them"
    p.add_argument("--dlogit-threshold", type=float, metavar="X",
                   help=f"flag a position whose |engine - golden| logit exceeds X ({by_precision})")
    p.add_argument("--cache-threshold", type=float, metavar="X",
                   help=f"flag a step whose compacted cache differs from the golden's by more than X ({by_precision})")
    p.add_argument("--min-tau", type=int, metavar="N", help="flag a DDTree step committing fewer than N tokens "
                                                            f"(default: {DEFAULT_MIN_TAU})")


def _threshold_overrides(args: argparse.Namespace) -> dict:
    """The thresholds given on the command line ({} when none), checked here so a bad one is one line."""
    from kdspec.traces.thresholds import Thresholds
    overrides = {name: value for name, value in (("dlogit", args.dlogit_threshold), ("cache", args.cache_threshold),
                                                  ("min_tau", args.min_tau)) if value is not None}
    try:
        Thresholds().with_values(**overrides)
    except ValueError as e:
        raise UsageError(str(e)) from None
    return overrides


DEMO_PROMPT = "def _get_loop(fut):\n"  # a held-out function header of pycoder-mini's corpus (asyncio/futures.py)


def _cmd_demo(args: argparse.Namespace) -> int:
    # the trained target and its trained drafter: on the GPU where there is one, else the float64 golden itself
    # (pycoder-mini is small enough for the CPU; the simulator is for toy sizes)
    backend = "cuda" if _gpu_visible() else "reference"
    from kdspec.engine.decode.config import DecodeConfig

    if args.out and os.path.lexists(args.out) and not args.force:
        raise UsageError(f"{args.out} exists (pass --force to overwrite it)")
    out = args.out or os.path.join(tempfile.mkdtemp(prefix="kdtree-demo-"), "demo.h5")
    try:
        config = DecodeConfig(args.max_new_tokens, mode="ddtree", drafter="dflash", block_size=8, budget=32)
    except ValueError as e:
        raise UsageError(str(e)) from None
    print(f"recording a DDTree trace of `pycoder-mini` (its trained dflash drafter, budget 32) to {out} ...",
          file=sys.stderr)
    prompt = _parse_prompt(argparse.Namespace(prompt_ids=None, prompt=DEMO_PROMPT, model="pycoder-mini"))
    summary = record_trace("pycoder-mini", out, prompt, config, backend=backend, force=args.force,
                           progress=_terminal(sys.stderr), golden=args.golden)
    print(f"recorded {summary['steps']} steps on {summary['backend']} ({summary['device']}), mean tau "
          f"{summary['mean_tau']:.2f}", file=sys.stderr)
    if args.no_tui:
        print(out)
        return 0
    from kdspec.kdtree_tui.app import run_app
    return run_app(out)


def _cmd_bench(args: argparse.Namespace) -> int:
    if args.quick:
        _select_backend("auto")  # toy sizes: the simulator stands in where there is no GPU
    from functools import partial

    from kdspec.engine.bench import runner, synthetic
    from kdspec.kdtree_tui import bench as tui_bench
    # the TUI suite measures the app on a synthetic trace, which the engine writes: the app never imports it
    tui = partial(tui_bench.run, write_trace=synthetic.write_synthetic_trace)
    try:
        rows = runner.run(args.suites, json=args.json, quick=args.quick, extra_suites={"tui": tui})
    except ValueError as e:
        raise UsageError(str(e)) from None
    return 1 if any(r.get("ok") is False for r in rows) else 0


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="kdtree",
        description="See inside DDTree speculative decoding: record step traces of an MLA+MoE engine, replay them.")
    parser.add_argument("--version", action="version", version=f"kdtree {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    p = sub.add_parser("config", help="print a model's configuration (preset name or model directory) as JSON")
    p.add_argument("model", help="preset (tiny, small, k2-mini) or a directory with config.json")
    p.set_defaults(func=_cmd_config)
    _add_record(sub.add_parser("record", help="decode with the engine and record every step to an HDF5 trace"))
    _add_trace_commands(sub)
    _add_demo_and_bench(sub)
    return parser


def _add_record(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny", help="preset (tiny, small, k2-mini) or a model directory")
    prompt = p.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", default="The tree",
                        help="prompt text, encoded with the model's tokenizer (its tokenizer.json; bytes for the presets)")
    prompt.add_argument("--prompt-ids", help="prompt token ids, comma-separated (e.g. 1,2,3), instead of --prompt")
    p.add_argument("--max-new-tokens", type=int, default=24, help="tokens to produce (the prefill's token counts)")
    p.add_argument("--mode", choices=("ar", "ddtree"), default="ddtree",
                   help="ar: one forward per token; ddtree: drafter + tree verify")
    p.add_argument("--drafter", help="oracle | noisy:P | dflash (the trained drafter beside the model) | dflash:DIR "
                                     "(ddtree only; default oracle)")
    p.add_argument("--block-size", type=int, default=8, help="bonus token + drafted depths L (2..32 in ddtree: the "
                   "compaction kernel moves at most 32 rows a step)")
    p.add_argument("--budget", type=int, default=7, help="tree node budget B (at most 1024: the device tree build "
                   "holds the tree in one block's shared memory)")
    p.add_argument("--topk", type=int, help="drafter top-K per depth (default min(B, V))")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0: sampled (Gumbel-max)")
    p.add_argument("--seed", type=int, default=0, help="weights of a preset, sampling noise, the noisy drafter")
    p.add_argument("--backend", choices=("auto", "cuda", "sim", "reference"), default="auto",
                   help="auto: cuda with a GPU, else the simulator (toy presets) or reference")
    p.add_argument("--weight-dtype", choices=("float32", "bfloat16"), default="float32",
                   help="device weights (bf16: half the memory, dense products and experts on bf16 tensor cores, and a "
                   "batch-invariant forward: DDTree commits exactly the engine's own AR tokens)")
    p.add_argument("--out", required=True, help="trace file to write (.h5)")
    p.add_argument("--force", action="store_true", help="overwrite an existing trace")
    p.add_argument("--save-logits", action="store_true", help="store full logits of committed positions (small V)")
    p.add_argument("--golden", choices=("auto", "cpu", "gpu", "none"), default="auto", help=GOLDEN_HELP)
    p.set_defaults(func=_cmd_record)


def _add_trace_commands(sub) -> None:
    """info, export, check, tui: the commands that read a trace."""
    p = sub.add_parser("info", help="summarise a trace: metadata, acceptance, calibration, the budget curve")
    p.add_argument("trace")
    p.add_argument("--json", action="store_true", help="machine-readable summary")
    p.add_argument("--step", type=int, metavar="N", help="why step N's tau was what it was (negative: from the end)")
    p.add_argument("--bench", metavar="FILE", help="`kdtree bench --json` rows: measured verify times for the "
                                                  "budget curve's cost model (default: fitted to the trace)")
    _add_threshold_options(p)
    p.set_defaults(func=_cmd_info)
    p = sub.add_parser("export", help="a trace as rows (jsonl / csv, per step or --nodes) or Perfetto JSON")
    p.add_argument("trace")
    p.add_argument("--format", choices=("jsonl", "csv", "perfetto"), default="jsonl", help="output format")
    p.add_argument("--nodes", action="store_true", help="one row per tree node instead of per step")
    p.add_argument("--out", metavar="FILE", help="write here (default: stdout)")
    p.set_defaults(func=_cmd_export)
    p = sub.add_parser("check", help="exit 0 when a trace is intact and equals the golden (or is intact, recorded "
                                     "with --golden none), 1 when it diverges, 2 when unreadable")
    p.add_argument("trace")
    p.set_defaults(func=_cmd_check)
    p = sub.add_parser("tui", help="replay a trace step by step in the terminal debugger")
    p.add_argument("trace")
    p.add_argument("--compare", metavar="OTHER", help="a second trace of the same prompt, side by side")
    p.add_argument("--follow", action="store_true", help="follow a trace that is still being recorded")
    _add_threshold_options(p)
    p.set_defaults(func=_cmd_tui)


def _add_demo_and_bench(sub) -> None:
    p = sub.add_parser("demo", help="record a DDTree trace of the trained pycoder-mini with its trained drafter "
                                    "(on the GPU, else the CPU) and open it")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to produce")
    p.add_argument("--out", help="where to write the trace (default: a temporary directory)")
    p.add_argument("--force", action="store_true", help="overwrite an existing --out file")
    p.add_argument("--no-tui", action="store_true", help="record only; print the trace path")
    p.add_argument("--golden", choices=("auto", "cpu", "gpu", "none"), default="auto", help=GOLDEN_HELP)
    p.set_defaults(func=_cmd_demo)
    _add_train(sub.add_parser("train", help="train the shipped models (needs the `train` extra: torch, transformers)"))
    p = sub.add_parser("bench", help="benchmarks with their peers, side by side in one run (exit 1: a target missed)")
    p.add_argument("suites", nargs="*", metavar="SUITE", help="tree, attention, moe, e2e, trace, spec, tui (default all)")
    p.add_argument("--json", action="store_true", help="rows as JSON")
    p.add_argument("--quick", action="store_true", help="toy sizes: checks the suites run (numbers mean nothing)")
    p.set_defaults(func=_cmd_bench)


def _add_train(parser: argparse.ArgumentParser) -> None:
    from kdspec.engine.train import drafter_train, target  # light: torch is imported only when a run starts

    what = parser.add_subparsers(dest="what", metavar="WHAT", required=True)
    p = what.add_parser("target", help="train the target model on the Python standard library (pycoder-mini's "
                                       "recipe) and write an HF model directory")
    target.add_arguments(p)
    p.set_defaults(func=_cmd_train_target)
    p = what.add_parser("drafter", help="train the DFlash-style block drafter of a target model directory (default "
                                        "pycoder-mini) on the target's own continuations")
    drafter_train.add_arguments(p)
    p.set_defaults(func=_cmd_train_drafter)


def _cmd_train_target(args: argparse.Namespace) -> int:
    from kdspec.engine.train import target
    return _run_training(target.run, args)


def _cmd_train_drafter(args: argparse.Namespace) -> int:
    from kdspec.engine.train import drafter_train
    return _run_training(drafter_train.run, args)


def _run_training(run, args: argparse.Namespace) -> int:
    from kdspec.engine.model.drafter import DrafterError
    from kdspec.engine.train.errors import TrainError
    try:
        return run(args)
    except (TrainError, DrafterError) as e:
        raise UsageError(" ".join(str(e).split())) from None


def main(argv: list[str] | None = None) -> int:
    """Run one command; its exit status. A closed stdout pipe ends it quietly (BROKEN_PIPE_EXIT)."""
    # The engine launches small grids on purpose (a block per tree, per few rows); Numba's occupancy hint would
    # print a line per kernel into every recording's output.
    warnings.filterwarnings("ignore", message=LOW_OCCUPANCY_HINT)
    try:
        parser = build_parser()
        try:
            args = parser.parse_args(argv)
        except SystemExit as e:  # --help, --version, a usage error (one line already printed)
            return e.code if isinstance(e.code, int) else 2
        try:
            code = args.func(args)
        except UsageError as e:
            _error_line(f"kdtree {args.command}: error: {e}")
            return 2
        except KeyboardInterrupt as e:
            _error_line(f"kdtree {args.command}: interrupted")
            return 143 if isinstance(e, Terminated) else 130
        except MemoryError:
            _error_line(f"kdtree {args.command}: error: out of memory (a smaller model, prompt or budget fits)")
            return 2
        sys.stdout.flush()  # here, not at exit, where a closed pipe would print a traceback
        return code
    except BrokenPipeError:
        _silence_stdout()
        return BROKEN_PIPE_EXIT


def _error_line(line: str) -> None:
    """One line on stderr; nothing when stderr is itself a closed pipe."""
    try:
        print(line, file=sys.stderr, flush=True)
    except (BrokenPipeError, OSError):
        pass


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's final flush does not fail on the closed pipe again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # no file descriptor (a captured stdout in tests)
        pass


if __name__ == "__main__":
    sys.exit(main())
