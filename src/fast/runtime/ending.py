"""The end of a run: every process's figures go to worker 0, which writes metrics.jsonl, model.pt and summary.json
(in a live run, the member that does worker 0's duties: the lowest live one, fast.runtime.live).

Under a strategy whose workers need each other, the end is collective: the final model (`final_model`), its
evaluation, and an all-gather of every process's figures. Under one that `survives_failures`, a collective
could not finish once a process is dead, so every live process sends worker 0 its figures (and a worker its
replica) point to point; worker 0 waits for each one it does not know to be dead, within the deadline, and
records a failed receive as a death. It then builds the final model from the replicas it holds, evaluates it,
writes the outputs with a `failures` list, and answers each survivor, which may then exit.
"""

from __future__ import annotations

import copy
import json
import os
import platform
import subprocess
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fast.comm import tags, timing
from fast.comm.arrivals import peers_fractions
from fast.comm.comm import limit_for, packed, unpacked
from fast.comm.timeline import chrome_trace, shares
from fast.emulation.deployment import bytes_per_link, emulated, record_of
from fast.emulation.deployment import describe as describe_deployment
from fast.errors import CommError, ConfigError, UsageError
from fast.runtime import checkpoints as checkpoint
from fast.runtime import files
from fast.runtime.evaluation import metrics_of
from fast.strategies.base import pick_replica
from fast.targets import best
from fast.version import __version__

END_TAG = tags.END_OF_RUN
SIMULATED_OWN_EVALUATIONS = 32  # the replicas a simulated run evaluates at its end unless eval.replicas says


def environment() -> dict[str, Any]:
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, cwd=Path(__file__).parent
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {
        "fast_version": __version__,
        "git_commit": commit or None,
        "torch_version": torch.__version__,
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
    }


# -- the run's end, collective or through worker 0 ---------------------------------------------------------------


def first_notices(failures: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per dead process: the first time anyone noticed it."""
    first: dict[int, dict[str, Any]] = {}
    for failure in sorted(failures, key=lambda f: f["unix_time"]):
        first.setdefault(failure["worker"], failure)
    return sorted(first.values(), key=lambda f: f["unix_time"])


# -- the outputs -----------------------------------------------------------------------------------------------------
def write_outputs(
    run_dir: Path,
    everyone: list[dict[str, Any]],
    model: nn.Module | dict[str, torch.Tensor] | None,
    summary: dict[str, Any],
) -> dict[str, Any]:
    """Worker 0 writes metrics.jsonl (every process's records), model.pt (of `model`, or a state already gathered:
    a sharded run's) and summary.json, each atomically. One the disk refuses (full, read-only) does not keep the
    others from being written; the first refusal is raised after them, and the summary lists what is missing
    (`unwritten`)."""
    records = sorted((r for p in everyone for r in p["records"]), key=lambda r: (r["time_s"], r["worker"]))
    outputs: list[tuple[str, Any]] = [
        ("metrics.jsonl", lambda: files.write_text(run_dir / "metrics.jsonl",
                                                   "".join(json.dumps(r) + "\n" for r in records))),
    ]  # fmt: skip
    if model is not None:  # a compiled model's own module: its keys load into the user's class
        given = model if isinstance(model, dict) else getattr(model, "_orig_mod", model).state_dict()
        state = {k: v.detach().cpu() for k, v in given.items()}
        outputs.append(("model.pt", lambda: checkpoint.save_atomic(state, run_dir / "model.pt")))
    if summary.get("config", {}).get("run", {}).get("trace"):
        traces = sorted((run_dir / "workers").glob("trace-*.json"))
        outputs.append(("trace.json", lambda: files.write_text(run_dir / "trace.json", chrome_trace(traces))))
    refused: list[files.OutputError] = []
    for name, write in outputs:
        try:
            write()
        except files.OutputError as error:
            refused.append(error)
            summary.setdefault("unwritten", []).append(name)
    try:
        files.write_text(run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
    except files.OutputError as error:
        refused.append(error)
    if refused:
        raise refused[0]
    return summary


def run_throughput(each: list[dict[str, Any]]) -> dict[str, Any]:
    """The run's achieved TFLOP/s (its workers' together) and MFU (against the peaks of the GPUs they ran on, each
    counted once where workers share one), from each worker's figures; {} where a worker has none (fast.runtime.
    throughput)."""
    if not each or not all("tflops" in w for w in each):
        return {}
    tflops = sum(w["tflops"] for w in each)
    peaks = {w.get("gpu") or i: w["peak_tflops"] for i, w in enumerate(each)}
    return {"tflops": float(f"{tflops:.4g}"), "mfu": float(f"{tflops / sum(peaks.values()):.4g}")}


def mean_shares(each: list[dict[str, float]]) -> dict[str, float] | None:
    """The workers' mean share of their training time per category (fast.comm.timeline)."""
    each = [s for s in each if s]
    if not each:
        return None
    return {key: round(sum(s[key] for s in each) / len(each), 4) for key in each[0]}


class Ending:
    """The end of the job's run (a part of fast.runtime.job.Job)."""

    def finish(self, eval_fn: Callable[[nn.Module], dict[str, float]] | None = None) -> dict[str, Any] | None:
        """End the run: wait for (or join) the other workers, the strategy's last exchanges, the final model by
        `final_model`, its evaluation (with `eval_fn`, else the last one job.evaluate had), and the outputs:
        metrics.jsonl, model.pt, summary.json. Returns the summary on worker 0, None on the others."""
        if self.finished:
            raise UsageError("job.finish() was already called")
        if self.model is None:
            raise UsageError("job.finish() before job.prepare(model, optimizer): there is nothing to finish")
        self._eval_fn = self._on_model(eval_fn) or self._eval_fn
        self._count_bad_steps()  # (a run of bad steps the loop's last boundary did not see fails here, before any wait)
        if self.simulated and self.is_main:
            from fast.emulation.wire import training_ends

            training_ends()
        try:
            summary = self._finish_worker()
            if self.live:
                self.member.done()  # (from here on its exit is no departure)
        finally:
            self._close()
        return summary

    def _join(self) -> None:
        """Workers in step end together: one that has run out of steps while the others go on takes part in their
        exchanges with no data (as DDP's Join) until the periodic check finds every worker done."""
        joined_at = self._ran_out_at = self.step
        self._bytes_when_ran_out = self.world.counter.snapshot()["bytes_sent"]
        self._settle(finishing=True)
        if self.stopped and self._checked_at != self.step:  # the plan ended here for all (a run resumed at its end)
            self._agree(done=True)
        while self._ended_at != self.step:
            if self._check_due(self.step) and self._checked_at != self.step:
                self._agree(done=True)
                continue
            self.driver.null_step()
            if self.strategy.nobody_contributed:  # every worker has ended (the exchange's counts say so): end here
                self._ended_at = self.step
                # sync's exchange is every step: the one before had data; a round's says only that none moved since
                # the last round, so the steps known from the last check stand
                last = self.step - 1 if self.strategy.waits_every_step else max(self._last_step_of_all, joined_at)
                self._last_step_of_all = last
        if self._last_step_of_all > joined_at:  # (all may end together, between two checks: steps without data)
            self.context.log(
                f"fast: worker {self.rank} ran out of steps at step {joined_at} while others went on: it took part in "
                f"their exchanges without data until step {self.step}, where they all ended"
            )

    def __enter__(self) -> Any:
        return self

    def __exit__(self, kind: Any, error: Any, tb: Any) -> None:
        if error is None and not self.finished and self.model is not None:
            self.finish()

    def _finish_worker(self) -> dict[str, Any] | None:
        if self.live:  # the members are at the same step: nobody is admitted from here on
            self._membership_ends()
        elif self.lockstep and self.workers > 1:
            self._join()
        if self._recorded_at != self.step and self.step > 0:
            self._record()  # the last steps' losses
        # training time ends at the last step: the end of the run may wait for other workers (an asynchronous peer
        # still training, worker 0 still evaluating), which is not this worker's training
        self.trained_s = self.clock.now()
        self.timeline.stop_counting()
        self.driver.detach()  # the user's steps are over: a strategy's own optimizer steps (ssp's last) are its own
        if self.lockstep and self.workers > 1 and not self.live:
            self.strategy.steps_of_all = self._last_step_of_all  # the most steps any worker took with data
        if self.live and not self.detached:
            return self._end_together()
        return self._end()

    def _end_together(self) -> dict[str, Any] | None:
        """A live run's end (its members in step): should a member die in its collectives (the strategy's last
        exchange, the final evaluation, the figures gathered), the others re-form without it, heal where that left
        them unlike, and end again; the lowest of them writes the outputs."""
        while True:
            try:
                return self._end()
            except CommError as e:
                self._regroup(failure=e)

    def _end(self) -> dict[str, Any] | None:
        """The strategy's end, the final model and its evaluation, and the outputs."""
        self.strategy.end_of_run()
        self.records.close()
        if self.strategy.survives_failures and not self.live:  # (a live run's members end together)
            return self._gather_from_survivors()
        if self.detached:  # the member that writes the outputs evaluates the servers' final weights, which all hold
            return self._gather_through_store(self._evaluated_final_weights)
        model = None
        if self._eval_fn is not None:
            self._evaluate(self._eval_fn, final=True)
            model = self.final_model
        else:
            with self.driver.evaluation():
                model = self.strategy.final_model()
        return self._gather_and_write(model)

    def _evaluated_final_weights(self) -> nn.Module:
        """(A detached run's member that writes the outputs) the end's evaluation of the servers' final weights,
        which every worker holds; the model to save."""
        if self._eval_fn is not None:
            self._evaluate(self._eval_fn, final=True)
        return self.model

    def _finish_server(self) -> None:
        if self.detached:
            self._gather_through_store()
        elif self.strategy.survives_failures:
            self._gather_from_survivors()
        else:
            self._gather_and_write(None)

    def _reduced_through(self) -> dict[str, str]:
        """What the job's own groups summed their all-reduces through, when they kept sums (run.shared_memory)."""
        groups = [comm for comm in self._own_groups() if comm.local_sums is not None]
        made = {summed.transport for comm in groups for summed in comm.local_sums.sums.values()}
        return {"all_reduce": ", ".join(sorted(made))} if made else {}

    def _bytes_in_empty_steps(self) -> int:
        if self._ran_out_at is None:
            return 0
        return self.world.counter.snapshot()["bytes_sent"] - self._bytes_when_ran_out

    def _own_figures(self) -> dict[str, Any]:
        """What this process contributes to the summary."""
        compensation = self.strategy.compensation.figures() if self.strategy.compensation is not None else {}
        own: dict[str, Any] = {
            "rank": self.rank,
            "server": self.is_server,
            "records": self.records.records,
            "staleness": self.strategy.staleness,
            "counter": self.world.counter.snapshot(),
            "strategy": {**self._reduced_through(), **self.strategy.summary(), **compensation},
            # the steps it took with data; those without (waiting for the others to end) apart
            "steps": 0 if self.is_server else self._ran_out_at if self._ran_out_at is not None else self.step,
            "empty_steps": self.step - self._ran_out_at if self._ran_out_at is not None else 0,
            "bytes_sent_in_empty_steps": self._bytes_in_empty_steps(),
            "samples": self.driver.samples,
            "samples_reported": self._samples_reported if self.live and not self.detached else None,
            "skipped_steps": self.skipped_steps,
            "steps_skipped_by_the_loop": self.driver.loop_skipped,
            "time_s": self.trained_s if self.is_worker else 0.0,  # the clock at its last step
            # the run's training time then (a live joiner's clock began at its start: fast.runtime.live)
            "run_time_s": self._run_time(self.trained_s) if self.is_worker else 0.0,
            # on a GPU: its achieved TFLOP/s and MFU, and which GPU, of which peak (fast.runtime.throughput)
            "throughput": self._worker_throughput() if self.is_worker else {},
            "compute_s": self.machine.compute_s,
            "compute_spread": self.machine.compute_spread,
            "request_s": self.machine.request_s,  # a server's (workers answer no requests)
            "shard": self.shard_index,  # of its replica (0 unsharded): the replica's figures are its shard 0's
        }
        if emulated(self.config):
            own["deployment"] = record_of(self.machine, self.world)
        if self.is_worker:
            own["timeline"] = dict(self.timeline.seconds)
        own["arrivals"] = self.timeline.arrivals.table()  # (a server's too: when it answered)
        own["thread"] = self.timeline.training_thread
        if self.config.run.trace:  # this process's part of trace.json, which worker 0 puts together
            part = self.run_dir / "workers" / f"trace-{self.rank}.json"
            part.write_text(json.dumps(self.timeline.chrome_events(self.role)))
        if self.is_worker and self.strategy.replicas_differ and self._eval_fn is not None and self._own_evaluated():
            with self.driver.evaluation():
                own["own_metrics"] = metrics_of(self._eval_fn, self.model)
        return own

    def _own_evaluated(self) -> bool:
        """Whether this worker's own replica is evaluated at the end (`eval.replicas`: evenly spaced by rank; by
        default every worker's in a run of processes, which evaluate at once, at most SIMULATED_OWN_EVALUATIONS in a
        simulated one, whose host evaluates them one after another: a full test set each, at 1,024 workers ten
        minutes of LeNet on 2 cores where its training took one)."""
        most = self.parts.evaluation.replicas or (SIMULATED_OWN_EVALUATIONS if self.simulated else None)
        return most is None or self.replica_index % -(-self.config.run.workers // most) == 0

    def _gather_and_write(self, model: nn.Module | None) -> dict[str, Any] | None:
        """Collective over all processes: worker 0 writes metrics.jsonl, summary.json and model.pt (a sharded run's
        gathered whole first, by replica 0's shards)."""
        whole = self._whole_state(model) if self.sharded is not None else model
        own = self._own_figures()
        payload = torch.frombuffer(bytearray(json.dumps(own).encode()), dtype=torch.uint8)
        with self.world.unmetered():
            parts = self.world.all_gather_bytes(payload.to(self.world.device))
        if not self.is_main:
            return None
        everyone = [json.loads(bytes(p.cpu().numpy().tobytes()).decode()) for p in parts]
        if not self.live:
            return write_outputs(self.run_dir, everyone, whole, self._summarize(everyone))
        # a live run's members gone by its end: their records too, and the evaluations of those that did worker 0's
        # duties before this one (the summary's changes of membership are the store's: fast.runtime.live)
        departed = self._departed_records(everyone)
        self._add_evaluations([r for r in departed if r.get("kind") == "eval"])
        summary = write_outputs(self.run_dir, [*everyone, {"records": departed}], whole, self._summarize(everyone))
        self.member.wrote()
        return summary

    def _gather_from_survivors(self) -> dict[str, Any] | None:
        """Every live process: hand the run's end to worker 0 (which returns the summary; the others None). On the
        ending line, a process that stays silent past the deadline is given up without breaking the others'."""
        world, strategy, line = self.world, self.strategy, self.ending_line
        figures = {**self._own_figures(), "failures": strategy.failures}
        replica = None if self.is_server else {k: v.detach().cpu() for k, v in self.model.state_dict().items()}
        if not self.is_main:
            # worker 0 may first wait on every other process, then evaluate and write: a longer deadline
            patience = world.deadline_s * (world.size + 2)
            with line.unmetered():
                line.send_bytes(packed(json.dumps(figures)), 0, tag=END_TAG, deadline_s=patience)
                line.send_bytes(packed(replica), 0, tag=END_TAG, deadline_s=patience)
                line.recv(torch.zeros(1), 0, tag=END_TAG, deadline_s=patience)
            return None
        everyone, replicas = [figures], [replica]
        # what the others hand in is like worker 0's own: their figures (records of as many steps, give or take)
        # and a replica of the same model; a longer one is refused before it is allocated
        figures_limit = 16 * packed(json.dumps(figures)).numel() + (64 << 20)
        replica_limit = limit_for(self.model.state_dict(), times=2)
        with line.unmetered():
            for rank in range(1, world.size):
                if rank in strategy.dead:
                    continue
                try:
                    everyone.append(json.loads(unpacked(line.recv_bytes(rank, tag=END_TAG, limit=figures_limit))))
                    theirs = unpacked(line.recv_bytes(rank, tag=END_TAG, limit=replica_limit))
                except CommError as e:
                    strategy.lost(rank, self.step, f"end of run: {e}")
                    continue
                if theirs is not None:
                    replicas.append(theirs)
        model = self._final_from_replicas(replicas)
        self._final_evaluation(model, replicas)
        summary = self._summarize(everyone)
        start = timing.wall() - self.clock.now()
        summary["failures"] = [
            {**failure, "time_s": round(failure["unix_time"] - start, 3)}
            for failure in first_notices([f for p in everyone for f in p["failures"]] + strategy.failures)
        ]
        summary = write_outputs(self.run_dir, everyone, model, summary)
        with line.unmetered():
            for p in everyone[1:]:
                try:
                    line.send(torch.ones(1), p["rank"], tag=END_TAG)
                except CommError:
                    pass  # it died after handing in its part: nothing left to tell it
        return summary

    def _final_from_replicas(self, replicas: list[dict[str, torch.Tensor]]) -> nn.Module:
        """The reported model from the survivors' replicas (worker 0's first), as `final_model` says: the average;
        the replica of worker K (the average if K is gone); the best by the validation score. A strategy whose
        replicas agree only has its floating buffers (batch norm) averaged."""
        strategy = self.strategy
        model = copy.deepcopy(self.model)
        ranks = [0] + [r for r in range(1, self.workers) if r not in strategy.dead]

        def scores() -> list[float]:
            found = []
            for replica in replicas:
                model.load_state_dict(replica)
                found.append(strategy.score(model))
            return found

        chosen = None
        if strategy.replicas_differ:
            chosen = pick_replica(strategy.options.final_model, ranks, self.workers, scores)
        if chosen is not None:
            model.load_state_dict(replicas[ranks.index(chosen)])
        else:  # the average (of the floating buffers only, batch norm's, where the replicas agree)
            averaged = None if strategy.replicas_differ else {name for name, _ in model.named_buffers()}
            with torch.no_grad():
                for name, tensor in model.state_dict().items():
                    if tensor.is_floating_point() and (averaged is None or name in averaged):
                        tensor.copy_(torch.stack([r[name] for r in replicas]).mean(0).to(tensor.device))
        return model

    def _final_evaluation(self, model: nn.Module, replicas: list[dict[str, torch.Tensor]]) -> None:
        """Worker 0 evaluates the final model and records it as the run's last evaluation (survivors' end)."""
        if self._eval_fn is None:
            return
        with self.clock.pause(), self.driver.evaluation():
            metrics = self._metrics_of(self._eval_fn, model)
        self._check_targets(metrics)
        divergence = None
        if self.strategy.replicas_differ:
            names = [name for name, _ in self.model.named_parameters()]
            flats = torch.stack([torch.cat([r[name].reshape(-1).float() for name in names]) for r in replicas])
            mean = flats.mean(0)
            divergence = float(((flats - mean).norm(dim=1) / mean.norm().clamp_min(1e-12)).mean())
        self._record_evaluation(metrics, divergence)

    def _eval_time_s(self) -> float | None:
        """Worker 0's mean time for an evaluation during the run; the final one's if there was none (the final one
        takes the whole test set, those during the run `eval.samples` of it)."""
        seconds = self.eval_seconds or self.final_eval_seconds
        return sum(seconds) / len(seconds) if seconds else None

    def _predicted_step_time(self, compute_s: float | None) -> float | None:
        """The cost model's step time for this run (fast.tools.predict) from the compute time the run measured, to set
        beside the measured step time; None when the strategy has no cost model."""
        from fast.pricing import predicted_step_time

        if compute_s is None or self.model is None:
            return None
        try:
            return predicted_step_time(self.config, model=self.model, compute_s=compute_s)
        except ConfigError:
            return None

    def _trace_waits_for_peers(self, everyone: list[dict[str, Any]], spans: list[list[tuple[float, float]]]) -> None:
        events = [{"name": "waiting for peers", "cat": "wait", "ph": "X", "pid": p["rank"], "tid": p["thread"],
                   "ts": start * 1e6, "dur": (end - start) * 1e6}
                  for p, mine in zip(everyone, spans, strict=True) for start, end in mine]  # fmt: skip
        (self.run_dir / "workers" / "trace-waits-for-peers.json").write_text(json.dumps(events))

    def _reported_figures(self) -> dict[str, Any]:
        """What a live run's summary counts of this member if it is gone by the end (`Member.report`: read on
        the heartbeat's thread, from the start, before the first group is formed)."""
        world, driver = getattr(self, "world", None), getattr(self, "driver", None)
        # holds_state: whether it holds the run's state, so that churn may take others out (a detached worker's is
        # on the servers: always)
        return {"rank": self.rank, "counter": world.counter.snapshot() if world is not None else None,
                "samples": driver.samples if driver is not None else 0,
                "step": driver.step if driver is not None else None,  # (whether it steps: `Coordinator`)
                "holds_state": bool(getattr(self, "_holds_state", True))}  # fmt: skip

    def _changes(self) -> list[dict[str, Any]]:
        """A live run's changes of membership, as the summary lists them (kept by the store: fast.runtime.live; a
        detached run's by its worker 0)."""
        return self.membership if self.detached else self.member.changes()

    def _departed(self, present: list[dict[str, Any]]) -> list[int]:
        """The members of a live run that were gone by its end."""
        ever = {m for event in self._changes() for m in event["members"]}
        return sorted(ever - {p["rank"] for p in present})

    def _figures_of_departed(self, present: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The figures of the members of a live run that were gone by its end, as of their last heartbeat."""
        figures = [self.member.figures_of(member) for member in self._departed(present)]
        return [f for f in figures if f is not None and f["counter"] is not None]

    def _departed_records(self, present: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The records of the members of a live run gone by its end, from their files in the run folder (a member
        that ran on this machine streamed them there as it went; one elsewhere left none here); a line its death
        cut short is skipped."""
        found = []
        for member in self._departed(present):
            try:
                lines = (self.run_dir / "workers" / f"metrics-{member}.jsonl").read_text().splitlines()
            except OSError:
                continue
            for line in lines:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if isinstance(record, dict) and record.get("worker") == member and "time_s" in record:
                    found.append(record)
        return found

    def _add_evaluations(self, records: list[dict[str, Any]]) -> None:
        """The evaluations of those that did worker 0's duties before this member (their "eval" records), before
        this one's own, in the order of their steps."""
        own = {e["step"] for e in self.records.evals}
        earlier = [{"step": r["step"], "time_s": r["time_s"],
                    **{k: v for k, v in r.items() if k.startswith("test_") or k == "divergence"}}
                   for r in records if "step" in r and r["step"] not in own]  # fmt: skip
        self.records.evals = sorted(earlier, key=lambda e: e["step"]) + self.records.evals

    def _summarize(self, everyone: list[dict[str, Any]]) -> dict[str, Any]:
        config, run = self.config, self.config.run
        trainers = [p for p in everyone if not p["server"]]
        # what the members gone by the end trained on and sent counts too (a fixed world's: nobody is gone)
        departed = self._figures_of_departed(everyone) if self.live else []
        counted = everyone + departed
        evals = self.records.evals
        final = evals[-1] if evals else {}
        wall = max(p["run_time_s"] for p in trainers)
        computes = [p["compute_s"] for p in trainers if p.get("compute_s") is not None]
        # a step's own work (its time minus its waits on communication) on the slowest worker, who sets the wall time
        compute_s = max(computes) if computes else None
        spreads = [p["compute_spread"] for p in trainers if p.get("compute_spread") is not None]
        requests = [p["request_s"] for p in everyone if p.get("request_s") is not None]
        steps = everyone[0]["steps"]  # worker 0's (asynchronous workers may end at different steps)
        if self.live and not self.detached:  # as the members reported them at each boundary (fast.runtime.live)
            samples = self.samples_trained + sum(p["samples"] - p["samples_reported"] for p in trainers)
        else:  # what the loop passed through the model (its first dimension), else steps x batch size
            samples = sum(p.get("samples") or p["steps"] * self.batch_size for p in trainers)
            samples += sum(p["samples"] for p in departed)
        sent = sum(p["counter"]["bytes_sent"] for p in counted)
        uncompressed = sum(p["counter"]["bytes_sent_uncompressed"] for p in counted)
        staleness = [s for p in everyone for s in p["staleness"]]
        fractions, waits_for_peers = peers_fractions([p.pop("arrivals", None) for p in everyone])
        if run.trace:  # inside each wait, its part waiting for peers: a part of trace.json of its own
            self._trace_waits_for_peers(everyone, waits_for_peers)
        worker_shares = [
            shares(p["timeline"], p["time_s"], fraction)
            for p, fraction in zip(everyone, fractions, strict=True)
            if not p["server"] and "timeline" in p
        ]
        blocked = [
            p["timeline"].get("wait", 0.0) / p["time_s"] for p in trainers if "timeline" in p and p["time_s"] > 0
        ]
        targets = run.parsed_targets
        time_to: dict[str, float | None] = {}
        for target in targets:
            key = f"test_{target.metric}"
            time_to[target.label] = next((e["time_s"] for e in evals if target.reached(e.get(key))), None)
        metric_names = sorted({k.removeprefix("test_") for e in evals for k in e if k.startswith("test_")})
        differ = self.strategy.replicas_differ
        summary: dict[str, Any] = {
            "name": run.name,
            "strategy": self.parts.options.name,
            "codec": config.codec.name,
            "workers": run.workers,
            "servers": len(everyone) - len(trainers),
            "epochs": self.planned_epochs if self.planned_epochs is not None else run.epochs,
            "steps_per_worker": steps,
            "steps_per_epoch": self.steps_per_epoch,
            "batch_size": self.batch_size,
            "final_model": self.strategy.options.final_model if differ else "replica",
            "final_test_accuracy": final.get("test_accuracy"),
            "final_test_loss": final.get("test_loss"),
            "best_test_accuracy": best("accuracy", [e["test_accuracy"] for e in evals if "test_accuracy" in e]),
            "wall_time_s": wall,
            "samples": samples,
            "empty_steps": max(p.get("empty_steps", 0) for p in trainers),  # (in bytes_sent, and apart:)
            "bytes_sent_in_empty_steps": sum(p.get("bytes_sent_in_empty_steps", 0) for p in everyone),
            "samples_per_s": samples / wall if wall > 0 else None,
            "step_time_s": wall / steps if steps else None,
            "bytes_sent": sent,
            "bytes_received": sum(p["counter"]["bytes_received"] for p in counted),
            "bytes_sent_uncompressed": uncompressed,
            # set-up and measurement (the start's broadcast, evaluations, divergence), not in bytes_sent
            "bytes_sent_unmetered": sum(p["counter"]["bytes_sent_unmetered"] for p in counted),
            "compression_ratio": uncompressed / sent if sent else None,
            "targets": [t.label for t in targets],
            "time_to_target_s": time_to,
            "time_to_accuracy_s": {
                f"{t.value:g}": time_to[t.label] for t in targets if t.metric == "accuracy" and t.op == ">="
            },
            "mean_staleness": sum(staleness) / len(staleness) if staleness else None,
            "max_staleness": max(staleness) if staleness else None,
            "staleness_histogram": {str(k): v for k, v in sorted(Counter(staleness).items())} or None,
            "skipped_steps": sum(p["skipped_steps"] for p in everyone),
            # steps the user's loop did not take (a GradScaler's overflow): the most on any worker (under sync every
            # worker skips the same ones)
            "steps_skipped_by_the_loop": max(p.get("steps_skipped_by_the_loop", 0) for p in trainers),
            "restarts": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),  # by the elastic agent (max_restarts)
            "replica_divergence": final.get("divergence"),
            "worker_test_accuracy": (
                [(p.get("own_metrics") or {}).get("accuracy") for p in trainers if not p.get("shard")]
                if differ
                else None
            ),
            "evaluations": evals,
            "config": config.as_used(self.loop_is_fast),
            "env": environment(),
            "step_compute_s": compute_s,
            "step_compute_spread": sum(spreads) / len(spreads) if spreads else None,
            "server_request_s": sum(requests) / len(requests) if requests else None,
            "eval_time_s": self._eval_time_s(),
            "time_shares": mean_shares(worker_shares),
            "worker_time_shares": worker_shares or None,
            # blocked on communication, peers and transfers together (what the cost models' compute leaves out)
            "time_blocked_share": round(sum(blocked) / len(blocked), 4) if blocked else None,
            "predicted_step_time_s": self._predicted_step_time(compute_s),
        }
        summary.update(run_throughput([p.get("throughput") or {} for p in trainers]))
        if run.shards > 1:  # each worker a replica of this many processes (fast.runtime.sharded)
            summary["shards"] = run.shards
        if self.live:
            changes = self._changes()
            summary["membership"] = changes
            summary["workers_at_end"] = self.workers
            summary["written_by"] = self.rank  # the member that did worker 0's duties at the end (fast.runtime.live)
            # (the first generation's are the founders' first weights, not a catch-up)
            summary["catch_up_bytes"] = sum(event["catch_up_bytes"] for event in changes[1:])
        for name in metric_names:
            if name not in ("accuracy", "loss"):
                summary[f"final_test_{name}"] = final.get(f"test_{name}")
                summary[f"best_test_{name}"] = best(name, [e[f"test_{name}"] for e in evals if f"test_{name}" in e])
        if emulated(config):
            summary["deployment"] = describe_deployment(config, [p["deployment"] for p in everyone])
            if config.network is not None and not self.live:
                summary["deployment"]["bytes_per_link"] = bytes_per_link(config, everyone)
        if self.simulated:
            from fast.emulation.wire import host_figures

            summary["simulation"] = host_figures()
        for p in everyone:  # strategy figures (a server's included); worker 0's come last and win
            if p["rank"]:
                summary.update(p["strategy"])
        summary.update(everyone[0]["strategy"])
        return summary
