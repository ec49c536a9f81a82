"""`fast train` and `fast run`: resolve the config, prepare the run folder, start the processes (or join torchrun's).

`fast train CONFIG` runs FAST's own training loop (fast.jobs.loop) in every process; `fast run SCRIPT` runs the user's
script, which calls fast.init. Both start `run.workers` processes plus the strategy's servers on this machine
(or under the elastic agent with run.max_restarts); under torchrun the process is already one of the job's.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
from pathlib import Path
from typing import Any

from fast.assemble import load_config
from fast.comm import bootstrap as engine
from fast.config import Config
from fast.errors import ConfigError, UnknownKey
from fast.factories import add_search_path
from fast.jobs.code import check_data
from fast.jobs.loop import train_worker
from fast.parts import Deployment, JobParts, UserCode, deployment_of, resolve
from fast.runtime import files
from fast.runtime.churn import ChurnDriver
from fast.runtime.launch import Interrupted, launch, launch_elastic, variables_set
from fast.runtime.membership import Coordinator
from fast.runtime.run_folder import check_folder, claim, claimed, default_run_dir, prepare_run_dir, release
from fast.strategies import strategy_for, strategy_options


def prepare(config: Any = None, *, out: str | Path | None = None, resume: str | Path | None = None,
            user: UserCode | None = None, **overrides: Any) -> tuple[JobParts, Path]:  # fmt: skip
    """The job resolved once (fast.parts) and its run folder (with config.toml written, and held by this process
    until `run_folder.release`); nothing is started."""
    if isinstance(config, str | Path) and Path(config).is_file():
        add_search_path(str(Path(config).resolve().parent))
    source = config
    if resume is not None:
        if not (Path(resume) / "config.toml").is_file():
            raise ConfigError(f"--resume {Path(resume)}: no config.toml there; give the folder of an earlier run")
        source = config if config is not None else Path(resume) / "config.toml"
    parts = resolve(source, user, **overrides)
    check_data(parts.data)  # data that is not there fails here, before anything starts (or any folder is made)
    if parts.deployment.churn is not None and user is not None and user.in_python:
        raise ConfigError(f"[faults] churn's joiners come through `fast join`, and this run trains {IN_PYTHON}")
    if resume is not None:
        run_dir = Path(resume)
    else:
        run_dir = Path(out) if out is not None else default_run_dir(parts.config.run.name)
    check_folder(run_dir)
    if not engine.under_torchrun():  # torchrun's ranks share the folder: no one of them holds it
        claim(run_dir)  # before anything in it is cleared: another live run may hold it
    try:
        prepare_run_dir(parts.config, run_dir, resume is not None, fast_loop=True)
    except BaseException:
        release(run_dir)
        raise
    return parts, run_dir


def _start(fn: Any, config: Config, deployment: Deployment, run_dir: Path, args: tuple,
           extra_env: dict[str, str] | None = None, resume: str = "fast train --resume {run_dir}",
           loop: str = "fast") -> dict:  # fmt: skip
    """Run `fn(*args)` in every process of the run, as its deployment says; returns {rank: value}. `resume`: the
    command that continues the run, shown when it is interrupted after a checkpoint; `loop`: what `fn` runs, which
    a live run's joiners must run too (fast.runtime.membership.LOOPS). Under torchrun this process is already one of
    the run's, which torchrun started."""
    if engine.under_torchrun():
        if deployment.engine == "simulated":
            raise ConfigError('run.engine = "simulated" runs every worker in one process: start it without torchrun')
        return {int(os.environ["RANK"]): fn(*args)}
    if deployment.engine == "simulated":
        return _simulate(fn, config, deployment, args, extra_env)
    addr = engine.resolved(deployment.addr)
    port = deployment.port or engine.free_port(addr)
    threads = deployment.threads_for(deployment.processes)
    try:
        if deployment.restarts:
            with variables_set(extra_env or {}):
                return launch_elastic(fn, deployment.processes, args, addr=addr, port=port, threads=threads,
                                      max_restarts=deployment.restarts)  # fmt: skip
        if deployment.live:
            return _launch_live(fn, config, deployment, run_dir, args, addr, threads, extra_env, loop)
        return launch(fn, deployment.processes, args, addr=addr, port=port, threads=threads,
                      survivable=deployment.survivable, extra_env=extra_env)  # fmt: skip
    except Interrupted as e:
        if any(run_dir.glob("checkpoints/*.pt")):
            hinted = Interrupted(f"{e}; continue with: {resume.format(run_dir=run_dir)}")
            hinted.exit_code = e.exit_code
            raise hinted from None
        raise


def _launch_live(fn: Any, config: Config, deployment: Deployment, run_dir: Path, args: tuple, addr: str,
                 threads: int, extra_env: dict[str, str] | None, loop: str) -> dict:  # fmt: skip
    """A live run: this launcher keeps its membership (fast.runtime.membership) while its founders train; any
    founder may die, worker 0 too (the lowest live member does its duties), others join with `fast join`, and the
    run goes on while a member is left, until one writes its outputs. (A detached strategy's servers take the ids
    after the workers': fast.runtime.detached.)"""
    coordinator = Coordinator(run_dir, config, deployment, addr, loop)
    churn = ChurnDriver(run_dir, deployment.churn, coordinator) if deployment.churn is not None else None
    try:
        outputs = launch(fn, deployment.processes, args, addr=addr, port=engine.free_port(addr), threads=threads,
                         survivable=True, extra_env={**(extra_env or {}), **coordinator.environment()},
                         on_exit=coordinator.exited, together=deployment.shards,
                         goes_on=coordinator.wait_for_the_end)  # fmt: skip
        writer, summary = coordinator.writer, run_dir / "summary.json"
        if writer is not None and writer not in outputs and summary.is_file():  # a joiner's (`fast join`'s) process
            outputs[writer] = json.loads(summary.read_text())
        return outputs
    finally:
        if churn is not None:
            churn.close()
        coordinator.close()


def _simulate(fn: Any, config: Config, deployment: Deployment, args: tuple, extra_env: dict[str, str] | None) -> dict:
    """The run's processes as tasks of one simulation in this process (run.engine = "simulated")."""
    from fast.runtime.simulate import simulate

    if deployment.restarts:
        raise ConfigError('run.max_restarts restarts real processes: leave it at 0 with run.engine = "simulated"')
    if config.run.device != "cpu":
        raise ConfigError('the simulated engine runs on the CPU: set run.device = "cpu" with run.engine = "simulated"')
    # the simulated processes share this one: what each sets process-wide (a script's sys.argv and its __main__
    # module, set and restored by runpy in the order the tasks interleave) is put back afterwards, or processes
    # this one starts later would run the script again as their __main__
    argv, main = list(sys.argv), sys.modules.get("__main__")
    try:
        with variables_set(extra_env or {}):
            return simulate(fn, config, deployment, args)
    finally:
        sys.argv[:] = argv
        if main is not None:
            sys.modules["__main__"] = main


def train(
    config: Any = None,
    *,
    out: str | Path | None = None,
    model_fn: Any = None,
    step_fn: Any = None,
    resume: str | Path | None = None,
    **overrides: Any,
) -> dict[str, Any]:
    """Run one training job to the end; returns the summary (on rank 0; {} on other torchrun ranks)."""
    user = UserCode(model_fn=model_fn, step_fn=step_fn)
    parts, run_dir = prepare(config, out=out, resume=resume, user=user, **overrides)
    loop = "python" if user.in_python else "fast"
    try:
        if parts.deployment.live:
            record_start(run_dir, loop)
        outputs = _start(train_worker, parts.config, parts.deployment, run_dir, (parts, run_dir, resume is not None),
                         loop=loop)  # fmt: skip
    finally:
        release(run_dir)
    # worker 0's, or the member's that did its duties in a live run (another torchrun rank's is empty)
    summary = next((value for _, value in sorted(outputs.items()) if isinstance(value, dict) and value), {})
    if summary:
        summary["run_dir"] = str(run_dir)
    return summary


# -- fast run SCRIPT ---------------------------------------------------------------------------------------------
def run_script_process(script: str, argv: list[str], cwd: str | None = None) -> None:
    """One process of `fast run`: the user's script as __main__ (which calls fast.init), in the launcher's folder
    `cwd` if given (a joiner's); a job it prepared but did not finish is finished here, so that no result is lost."""
    from fast.runtime import job as jobs

    if cwd is not None:
        os.chdir(cwd)
    sys.argv = [script, *argv]
    add_search_path(str(Path(script).resolve().parent))
    runpy.run_path(script, run_name="__main__")
    unfinished = jobs.unfinished()
    if unfinished is not None:
        if unfinished.is_main:
            print("fast: the script did not call job.finish(): finishing the run for it", file=sys.stderr)
        unfinished.finish()


START_FILE = "start.json"  # (a live run's folder) how its workers start: a joiner starts the same way
RECORDED_VARIABLES = ("FAST_OVERRIDES", "FAST_CONFIG", "FAST_CODE_PATH")
IN_PYTHON = ("code given to fast.train in Python (model_fn, step_fn), which no joiner can start: name it in the config "
             '(model.factory = "package.module:function"), or train a script with `fast run`')  # fmt: skip


def record_start(run_dir: Path, loop: str, script: str = "", argv: list[str] | None = None,
                 env: dict[str, str] | None = None) -> None:  # fmt: skip
    """Write down in `run_dir` how a worker of this live run starts, for its joiners (`recorded_script`): its `loop`
    is FAST's own on the run's config ("fast"), one with code given in Python, which no joiner can start ("python"),
    or the user's `script` with its arguments ("script"). (Every live run writes it: none is left from another.)"""
    record: dict[str, Any] = {"loop": loop}
    if loop == "script":
        record.update(script=script, argv=list(argv or []), cwd=os.getcwd(),
                      environment={k: v for k, v in (env or {}).items() if k in RECORDED_VARIABLES})  # fmt: skip
    run_dir.mkdir(parents=True, exist_ok=True)
    files.write_text(run_dir / START_FILE, json.dumps(record), private=True)


def recorded_script(run_dir: Path) -> tuple[str, list[str], str, dict[str, str]] | None:
    """(`fast join` of a run of this machine) the script its workers run, their arguments, folder and launcher's
    environment; None for a run of FAST's own loop. The file is checked before anything of it is used."""
    path = run_dir / START_FILE
    try:
        record = json.loads(path.read_text()) if path.is_file() else {"loop": "fast"}  # (a run of an older FAST)
        loop = record["loop"]
        if loop == "python":
            raise ConfigError(f"fast join: this run trains {IN_PYTHON}")
        if loop == "fast" and len(record) == 1:
            return None
        script, argv, cwd, env = record["script"], record["argv"], record["cwd"], record["environment"]
        checked = (loop == "script" and isinstance(script, str) and Path(script).is_file() and isinstance(cwd, str)
                   and Path(cwd).is_dir() and isinstance(argv, list) and all(isinstance(arg, str) for arg in argv)
                   and isinstance(env, dict)
                   and all(k in RECORDED_VARIABLES and isinstance(v, str) for k, v in env.items()))  # fmt: skip
    except (OSError, ValueError, TypeError, KeyError):
        checked = False
    if not checked:
        raise ConfigError(f"fast join: {path} is not what FAST wrote there (FAST's loop, or a script that exists with "
                          "its arguments, folder and launcher's settings): start the run again, or join it with FAST's "
                          "own loop through --address, --token-file and --config")  # fmt: skip
    return script, argv, cwd, env


def launcher_view(config: str | None, overrides: dict[str, Any]) -> Config:
    """What the launcher needs of the run (workers, servers, name, restarts, address): `config` and the overrides.
    Keys that only the script's own config makes valid ([model] width with its factory, say) are left to the
    script's fast.init, which checks them all."""
    try:
        return load_config(config, **overrides)
    except UnknownKey:  # (no config of the script's gives a table a key it does not have)
        raise
    except ConfigError as error:
        launcher = {k: v for k, v in overrides.items() if k.startswith(("run__", "strategy__", "run.", "strategy."))}
        try:
            return load_config(config, **launcher)
        except ConfigError:
            raise error from None


def script_settings(script: str, config: str | None, overrides: dict[str, Any]) -> dict[str, str]:
    """The settings (RECORDED_VARIABLES) with which each process of a script's run starts `script`: its fast.init
    takes `config` (a TOML path) in place of its own, if given, and the dotted `overrides` on top."""
    add_search_path(str(Path(script).resolve().parent))
    return {
        "FAST_OVERRIDES": json.dumps({k.replace("__", "."): v for k, v in overrides.items()}),
        **({"FAST_CONFIG": str(Path(config).resolve())} if config else {}),
        "FAST_CODE_PATH": os.environ["FAST_CODE_PATH"],
    }


def run_script(
    script: str,
    argv: list[str] | None = None,
    *,
    workers: int | None = None,
    config: str | None = None,
    out: str | Path | None = None,
    resume: str | Path | None = None,
    **overrides: Any,
) -> dict[str, Any] | None:
    """`fast run`: the user's `script` in every process of a run. `workers`, `config` (a TOML path) and the
    dotted `overrides` are the launcher's: the script's fast.init takes its own config and these on top."""
    if not Path(script).is_file():
        raise ConfigError(f"fast run: script {script} does not exist: give the path of a Python file")
    if config is not None and not Path(config).is_file():
        raise ConfigError(f"fast run --config {config}: no such file: give the path of a TOML file or a package")
    if workers is not None and workers < 1:
        raise ConfigError(f"fast run --workers {workers}: a run needs at least 1 worker")
    base = launcher_view(config, overrides)
    workers = workers or base.run.workers
    launcher_config = load_config(base, run__workers=workers)
    env = script_settings(script, config, {**overrides, "run__workers": workers})
    deployment = deployment_of(launcher_config, strategy_for(launcher_config), strategy_options(launcher_config))
    run_dir = Path(resume or out or default_run_dir(launcher_config.run.name))
    env["FAST_RUN_DIR"] = str(run_dir.resolve())
    if resume:
        env["FAST_RESUME"] = str(Path(resume).resolve())
    resume_command = " ".join(["fast run --resume {run_dir}", script, *(argv or [])])
    with claimed(run_dir):
        if deployment.live:
            record_start(run_dir, "script", str(Path(script).resolve()), list(argv or []), env)
        _start(run_script_process, launcher_config, deployment, run_dir,
               (str(Path(script).resolve()), list(argv or [])), env, resume_command, loop="script")  # fmt: skip
    summary_file = run_dir / "summary.json"
    if not summary_file.is_file():
        return None
    summary = json.loads(summary_file.read_text())
    summary["run_dir"] = str(run_dir)
    return summary
