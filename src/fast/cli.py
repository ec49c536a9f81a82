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


def cmd_compare(args: argparse.Namespace) -> int:
    from fast.compare import compare

    return 1 if compare(args.config, out=args.out, **_overrides(args.set)).failed else 0


def cmd_report(args: argparse.Namespace) -> int:
    from fast.compare import rebuild_report

    rebuild_report(args.dir)
    return 0


def cmd_predict(args: argparse.Namespace) -> int:
    from fast.predict import print_predictions

    print_predictions(args.config)
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fast", description="Flexible (A)synchronous Scalable Training")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train one job: fast train CONFIG.toml [--set key=value ...] [--out DIR]")
    t.add_argument("config", nargs="?", help="TOML config (with --resume: defaults to the run's own config)")
    t.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a key")
    t.add_argument("--out", help="run folder (default runs/<name>-<timestamp>)")
    t.add_argument("--resume", metavar="DIR", help="continue the run in DIR from its last checkpoint")
    t.set_defaults(func=cmd_train)
    top = sub.add_parser("topology", help="print a topology's neighbours, mixing weights and spectral gap")
    top.add_argument("spec", help='e.g. "torus:4x4", "ring", "exponential", "random-regular:3"')
    top.add_argument("--workers", "-n", type=int, help="number of workers (implied by torus:RxC)")
    top.set_defaults(func=cmd_topology)
    pr = sub.add_parser("predict", help="predict each variant's step and epoch time and traffic, without training")
    pr.add_argument("config", help="TOML config, optionally with [[variant]] tables")
    pr.set_defaults(func=cmd_predict)
    c = sub.add_parser("compare", help="run a base job's [[variant]]s one after another and report them")
    c.add_argument("config", help="TOML config: a base job plus [[variant]] tables overriding its keys")
    c.add_argument("--out", help="folder for the runs and report.html (default runs/<name>-compare-<time>)")
    c.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a key in all")
    c.set_defaults(func=cmd_compare)
    r = sub.add_parser("report", help="rebuild report.html and summary.csv from the run folders in DIR")
    r.add_argument("dir", help="a folder `fast compare` wrote (its subfolders hold the runs)")
    r.set_defaults(func=cmd_report)
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
