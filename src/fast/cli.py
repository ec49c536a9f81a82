"""The `fast` command line: train, and the tools around it. Errors are one line and a non-zero exit."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from fast.config import parse_value
from fast.errors import ConfigError, FastError


def _overrides(pairs: list[str]) -> dict[str, Any]:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set {pair!r} must look like key=value, e.g. --set run.workers=2")
        out[key.strip().replace(".", "__")] = parse_value(value.strip())
    return out


def cmd_train(args: argparse.Namespace) -> int:
    from fast.run import train

    summary = train(args.config, out=args.out, resume=args.resume, **_overrides(args.set))
    from fast.summary_text import print_summary

    print_summary(summary)
    return 0


def cmd_topology(args: argparse.Namespace) -> int:
    from fast.topology import format_topology

    print(format_topology(args.spec, args.workers))
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fast", description="Flexible (A)synchronous Scalable Training")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser(
        "train", help="train one job: fast train CONFIG.toml [--set key=value ...] [--out DIR]"
    )
    t.add_argument("config", nargs="?", help="TOML config (with --resume: defaults to the run's own config)")
    t.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a key")
    t.add_argument("--out", help="run folder (default runs/<name>-<timestamp>)")
    t.add_argument("--resume", metavar="DIR", help="continue the run in DIR from its last checkpoint")
    t.set_defaults(func=cmd_train)
    top = sub.add_parser("topology", help="print a topology's neighbours, mixing weights and spectral gap")
    top.add_argument("spec", help='e.g. "torus:4x4", "ring", "exponential", "random-regular:3"')
    top.add_argument("--workers", "-n", type=int, help="number of workers (implied by torus:RxC)")
    top.set_defaults(func=cmd_topology)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.func(args)
    except FastError as e:
        print(f"fast: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("fast: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
