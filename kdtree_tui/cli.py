"""The `kdtree` command line: the one place that joins engine, traces and app.

The engine (and so numba) is imported lazily inside the commands that need it, so that `kdtree tui`
starts fast and works where numba is absent. Errors the user can fix print one line and exit 2.
"""
from __future__ import annotations

import argparse
import json
import sys


class UsageError(Exception):
    """Bad input from the user: printed as one line, exit status 2."""


def _cmd_config(args: argparse.Namespace) -> int:
    from engine.config import ConfigError, resolve_config

    try:
        cfg = resolve_config(args.model)
    except ConfigError as e:
        raise UsageError(str(e)) from None
    print(json.dumps(cfg.to_hf_dict(), indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kdtree",
        description="See inside DDTree speculative decoding: record step traces of an MLA+MoE engine, replay them.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser("config", help="print a model's configuration (preset name or model directory) as JSON")
    p.add_argument("model", help="preset (tiny, small, k2-mini) or a directory with config.json")
    p.set_defaults(func=_cmd_config)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except UsageError as e:
        print(f"kdtree {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"kdtree {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
