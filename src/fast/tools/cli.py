"""The `fast` command line: train, and the tools around it. Errors are one line and a non-zero exit."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from fast.errors import ConfigError, FastError
from fast.interrupts import held_interrupts, how_interrupted, stopped_on_termination

UNSIGNED = "a package: train it though no --trust key verified it (as you would run its author's code)"


def _overrides(pairs: list[str], trust: str | None = None, unsigned: bool = False) -> dict[str, Any]:
    """`--set key=value` pairs as `fast.train`'s overrides; `--trust KEY.pub` as the package's trusted key,
    `--unsigned` as the owner's word to train a package no trusted key verified."""
    from fast.config import parse_value

    out: dict[str, Any] = {"package__trusted_key": str(trust)} if trust else {}
    if unsigned:
        out["package__unsigned"] = True
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set {pair!r} must look like key=value, e.g. --set run.workers=2")
        out[key.strip().replace(".", "__")] = parse_value(value.strip())
    return out


def cmd_train(args: argparse.Namespace) -> int:
    from fast.tools.start import train
    from fast.tools.summary_text import print_summary

    overrides = _overrides(args.set, args.trust, args.unsigned)
    summary = train(args.config, out=args.out, resume=args.resume, **overrides)
    if summary:  # under torchrun only rank 0 has it
        print_summary(summary)
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from fast.tools.start import run_script
    from fast.tools.summary_text import print_summary

    overrides = _overrides(args.set, args.trust, args.unsigned)
    summary = run_script(
        args.script, args.args, workers=args.workers, config=args.config, out=args.out, resume=args.resume, **overrides
    )
    if summary:
        print_summary(summary)
    return 0


def cmd_join(args: argparse.Namespace) -> int:
    from fast.tools.join import join

    run_dir, script_args = args.run_dir, args.args
    if args.script is None and script_args:
        given = " ".join([run_dir, *script_args] if run_dir is not None else script_args)
        raise ConfigError(f"fast join: {given}: arguments for a script, but no --script SCRIPT given")
    if args.script is not None:
        if args.address is None:
            raise ConfigError("fast join --script: give the run's --address and --token-file (a run of this machine "
                              "is joined from its folder, with the script it records: fast join RUN_DIR)")  # fmt: skip
        if run_dir is not None:  # (argparse's, of the script's arguments after --)
            run_dir, script_args = None, [run_dir, *script_args]
    member = join(run_dir, address=args.address, token_file=args.token_file, config=args.config, out=args.out,
                  standby=args.standby, script=args.script, script_args=script_args,
                  **_overrides(args.set))  # fmt: skip
    if member is not None:  # (None: a standby, which has said how it ended)
        print(f"fast: worker {member} trained with the run to its end")
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    from fast.tools.stop import stop

    address = stop(args.run_dir, address=args.address, token_file=args.token_file)
    print(f"fast: the run at {address} ends at its members' next boundary")
    return 0


def cmd_topology(args: argparse.Namespace) -> int:
    from fast.topology import format_topology

    print(format_topology(args.spec, args.workers))
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from fast.tools.comparison import compare

    if args.args and not args.script:
        raise ConfigError(f"fast compare: {' '.join(args.args)}: arguments for a script, but no --script SCRIPT given")
    script = {"script": args.script, "script_args": args.args} if args.script else {}
    overrides = _overrides(args.set, args.trust, args.unsigned)
    return 1 if compare(args.config, out=args.out, **script, **overrides).failed else 0


def cmd_report(args: argparse.Namespace) -> int:
    from fast.tools.comparison import rebuild_report

    rebuild_report(args.dir)
    return 0


def cmd_predict(args: argparse.Namespace) -> int:
    from fast.tools.predict import print_predictions

    print_predictions(args.config, **_overrides(args.set, args.trust, args.unsigned))
    return 0


def cmd_pack(args: argparse.Namespace) -> int:
    from fast.tools.pack import names_path, pack

    out = pack(args.config, args.out, metric=args.metric, sign=args.sign, open_keys=tuple(args.open),
               fixed_keys=tuple(args.fix), **_overrides(args.set))  # fmt: skip
    print(f"packed {out} ({out.stat().st_size:,} B); the map back to your names: {names_path(out)} (keep it)")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from fast.tools.pack import describe

    print(describe(args.package, args.trust))
    return 0


def cmd_keys(args: argparse.Namespace) -> int:
    from fast.tools.pack import make_keys

    private, public = make_keys(args.prefix)
    print(f"{private}: your private key (fast pack --sign {private}); {public}: give it to the data owners")
    return 0


def cmd_reference(args: argparse.Namespace) -> int:
    from fast.tools.reference import markdown

    print(markdown(), end="")  # the configuration reference: `fast reference > docs/configuration.md`
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fast", description="Flexible (A)synchronous Scalable Training")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train one job: fast train CONFIG.toml [--set key=value ...] [--out DIR]")
    t.add_argument("config", nargs="?", help="TOML config (with --resume: defaults to the run's own config)")
    t.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a key")
    t.add_argument("--out", help="run folder (default runs/<name>-<timestamp>)")
    t.add_argument("--resume", metavar="DIR", help="continue the run in DIR from its last checkpoint")
    t.add_argument("--trust", metavar="KEY.pub", help="a package: train it only if this author's key signed it")
    t.add_argument("--unsigned", action="store_true", help=UNSIGNED)
    t.set_defaults(func=cmd_train)
    run = sub.add_parser(
        "run",
        help="run your own training script on N workers: fast run [--workers N] [--config job.toml] SCRIPT [args]",
        description="Start SCRIPT (which calls fast.init) in every process of a run on this machine; launcher "
        "options come before the script, the script's own arguments after it.",
    )
    run.add_argument("--workers", "-n", type=int, help="worker processes (default: the config's run.workers)")
    run.add_argument("--config", help="TOML config or JOB.fastjob; replaces the one the script gives fast.init")
    run.add_argument("--trust", metavar="KEY.pub", help="a package: run it only if this author's key signed it")
    run.add_argument("--unsigned", action="store_true", help=UNSIGNED)
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a key")
    run.add_argument("--out", help="run folder (default runs/<name>-<timestamp>)")
    run.add_argument("--resume", metavar="DIR", help="continue the run in DIR from its last checkpoint")
    run.add_argument("script", help="a Python script that calls fast.init")
    run.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    run.set_defaults(func=cmd_run)
    j = sub.add_parser(
        "join",
        help="join a running live job: fast join RUN_DIR, or --address HOST:PORT --token-file F, and --config C or "
        "--script S -- ARGS",
    )
    j.add_argument("run_dir", nargs="?", help="the folder of a run of this machine (its address and secret are there)")
    j.add_argument("--address", metavar="HOST:PORT", help="the run's membership address (its membership.json)")
    j.add_argument("--token-file", metavar="F", help="the run's secret (its membership.secret), for another machine")
    j.add_argument("--config", help="the run's config (default: the run folder's config.toml)")
    j.add_argument("--out", help="where this worker writes its metrics (default: the run folder)")
    j.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a key")
    standby = "get ready (imports, config), then fork a joiner for each line on stdin (a file named on it: its stderr)"
    j.add_argument("--standby", action="store_true", help=standby)
    j.add_argument("--script", help="another machine's run of `fast run SCRIPT`: this machine's copy of the script")
    j.add_argument("args", nargs="*", help="the script's own arguments, after -- (… --script S -- ARGS)")
    j.set_defaults(func=cmd_join)
    st = sub.add_parser("stop", help="end a live run cleanly: fast stop RUN_DIR, or --address --token-file")
    st.add_argument("run_dir", nargs="?", help="the folder of a run of this machine")
    st.add_argument("--address", metavar="HOST:PORT", help="the run's membership address (its membership.json)")
    st.add_argument("--token-file", metavar="F", help="the run's secret (its membership.secret)")
    st.set_defaults(func=cmd_stop)
    top = sub.add_parser("topology", help="print a topology's neighbours, mixing weights and spectral gap")
    top.add_argument("spec", help='e.g. "torus:4x4", "ring", "exponential", "random-regular:3"')
    top.add_argument("--workers", "-n", type=int, help="number of workers (implied by torus:RxC)")
    top.set_defaults(func=cmd_topology)
    pr = sub.add_parser("predict", help="predict each variant's step and epoch time and traffic, without training")
    pr.add_argument("config", help="TOML config, optionally with [[variant]] tables, or JOB.fastjob")
    pr.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a package: the owner's keys")
    pr.add_argument("--trust", metavar="KEY.pub", help="a package: only if this author's key signed it")
    pr.add_argument("--unsigned", action="store_true", help=UNSIGNED)
    pr.set_defaults(func=cmd_predict)
    c = sub.add_parser("compare", help="run a base job's [[variant]]s one after another and report them")
    c.add_argument("config", help="TOML config: a base job plus [[variant]] tables overriding its keys")
    c.add_argument("--out", help="folder for the runs and report.html (default runs/<name>-compare-<time>)")
    c.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a key in all")
    c.add_argument("--trust", metavar="KEY.pub", help="a package: run it only if this author's key signed it")
    c.add_argument("--unsigned", action="store_true", help=UNSIGNED)
    c.add_argument("--script", help="your own training script (which calls fast.init), run as `fast run` does")
    c.add_argument("args", nargs="*", help="the script's own arguments, after -- (… --script S -- ARGS)")
    c.set_defaults(func=cmd_compare)
    pk = sub.add_parser("pack", help="export a job into one archive that trains without its source")
    pk.add_argument("config", help="TOML config of the job (its model and loss are exported)")
    pk.add_argument("--out", required=True, help="the archive to write, e.g. job.fastjob")
    pk.add_argument("--sign", metavar="KEY", help="sign with this ed25519 private key (fast keys)")
    pk.add_argument("--metric", metavar="MODULE:FUNCTION", help="metric(outputs, labels) -> {name: scalar}")
    pk.add_argument(
        "--open",
        action="append",
        default=[],
        metavar="KEY",
        help="a key of your training recipe "
        '(optimizer, schedule, length, batch) the data owner may set ("optimizer.lr", "schedule.*")',
    )
    pk.add_argument("--fix", action="append", default=[], metavar="KEY", help="a key of the deployment the data "
                    'owner may not set ("strategy.*", "run.workers"); the rest of it is theirs')  # fmt: skip
    pk.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a key")
    pk.set_defaults(func=cmd_pack)
    ins = sub.add_parser("inspect", help="print what a package holds (config, schema, sizes, hashes, signer)")
    ins.add_argument("package", help="a .fastjob archive")
    ins.add_argument("--trust", metavar="KEY.pub", help="verify its signature with this public key")
    ins.set_defaults(func=cmd_inspect)
    keys = sub.add_parser("keys", help="make an ed25519 key pair for signing packages: PREFIX.key, PREFIX.pub")
    keys.add_argument("prefix", help="e.g. keys/author")
    keys.set_defaults(func=cmd_keys)
    ref = sub.add_parser(
        "reference", help="print the configuration reference (docs/configuration.md): every key, strategy and codec"
    )
    ref.set_defaults(func=cmd_reference)
    r = sub.add_parser("report", help="rebuild report.html and summary.csv from the run folders in DIR")
    r.add_argument("dir", help="a folder `fast compare` wrote (its subfolders hold the runs)")
    r.set_defaults(func=cmd_report)
    return p


def main(argv: list[str] | None = None) -> int:
    with stopped_on_termination():  # SIGTERM and SIGHUP end a run as Ctrl-C does
        return _command(argv)


def _command(argv: list[str] | None) -> int:
    try:
        # an import cut short can leave a library half set up (or swallow the interrupt): Ctrl-C waits for them
        with held_interrupts():
            argv = sys.argv[1:] if argv is None else argv
            tail = argv[argv.index("--") + 1 :] if argv[:1] == ["compare"] and "--" in argv else None
            args = parser().parse_args(argv if tail is None else argv[: len(argv) - len(tail) - 1])
            if tail is not None:  # `fast compare ... --script S -- ARGS`: the script's own arguments, as given
                args.args = tail
            import fast.jobs.loop  # noqa: F401 - torch and the job's stack, which the commands use
        return args.func(args)
    except FastError as e:
        shown = getattr(e, "traceback", None)
        if shown:  # the user's code raised: its own traceback, once
            print(shown.rstrip(), file=sys.stderr)
        print(f"fast: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt as e:
        how, code = how_interrupted(e)
        print(f"fast: interrupted ({how})", file=sys.stderr)
        return code


if __name__ == "__main__":
    sys.exit(main())
