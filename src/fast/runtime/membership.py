"""Live membership: who is in a live run (`run.membership = "live"`), generation by generation, on c10d's TCPStore.

The launcher of the run hosts the store and runs the `Coordinator`; every worker holds a `Member`. The store is
the one engine (as torchrun's rendezvous): atomic counters and keys, no consensus of FAST's own. A generation is
a numbered list of member ids; a member's rank in the generation's process group is its place in the list, and
each generation's group lives under a key prefix of its own. The coordinator alone publishes generations: when
a member dies (its process exits, or its heartbeats stop), leaves (SIGTERM: it says so before it goes), is
suspected by a peer whose collective with it failed, or when a joiner is admitted. The members switch at the
points their strategy can take a change (fast.runtime.live), all at the same step. Once the run is ending (its members
have taken their last step), nobody comes in: a generation only loses members that die in the end's collectives, and
the survivors end again without them; a member whose end went through says so, and its exit is no departure.

A sharded run's (`run.shards = K`) members are its replicas' processes, K consecutive ids to a replica (its shard k
is id r·K + k), and a replica comes and goes whole: a joiner is admitted as K ids at once and enters a generation
once all K are ready, and when one of a replica's processes goes, the generation leaves out all of them (its
launcher stops the others: fast.runtime.launch). So a generation's members are whole replicas in order, and its
group's ranks are laid out as a fixed sharded run's (fast.shards.layout).

Who may reach the run's store, and so join it, stop it or change anything in it, is the rule of
fast.runtime.run_store: holders of the run's secret (`membership.secret`, written 0600 in the run folder; the
founders read it there, a remote joiner is given it as a file), proved on every connection. A joiner's config must
also equal the run's but for the keys each process may set for itself (`PER_PROCESS_KEYS`). What a holder of the
secret writes is still read with care: a malformed request, heartbeat or note is one refused value, logged in one
line, and the coordinator goes on.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fast.comm import bootstrap as engine
from fast.comm.comm import Comm
from fast.config import Config
from fast.errors import ConfigError, FastError
from fast.ownership import flat
from fast.parts import Deployment
from fast.runtime import files
from fast.runtime.run_store import Refused as StoreRefused
from fast.runtime.run_store import RunStore, RunStoreServer

# what the run's workers run, which a joiner's must run too (a heal of one loop cannot meet the other's)
LOOPS = {"fast": "FAST's own loop on its config", "script": "a script (fast run)",
         "python": "code given to fast.train in Python (model_fn, step_fn)"}  # fmt: skip
SECRET_FILE = "membership.secret"
ADDRESS_FILE = "membership.json"
ADDRESS_VARIABLE = "FAST_MEMBERSHIP"  # a member's way to the store: HOST:PORT
SECRET_VARIABLE = "FAST_MEMBERSHIP_SECRET_FILE"  # and the file that holds the run's secret (never the secret itself)
HEARTBEAT_S = 0.5  # how often a member says it is alive
SILENT_S = 10.0  # a member silent this long is dropped (a local process's exit is seen at once)
POLL_S = 0.02
FORM_S = 10.0  # the longest a member waits for another to form a generation's group
PREFIX = "fast/membership/"
SLOT_S = 5.0  # a request counted but not written this long is skipped (its writer died between the two)
# config keys a joiner may hold differently from the run: where its own outputs go and how it runs locally
PER_PROCESS_KEYS = ("run.threads_per_worker", "run.device", "run.tensorboard", "run.trace", "run.master_port")


class Refused(ConfigError):
    """The coordinator did not admit a joiner (exit code 2): the reason names what to change."""


class RunEnded(FastError):
    """The run ended (or failed) while this member waited to take part."""


@dataclass(frozen=True)
class Generation:
    """One membership: its number, its members (ids; a member's rank is its place) and what changed."""

    number: int
    members: list[int]
    joined: list[int] = field(default_factory=list)
    left: list[dict[str, Any]] = field(default_factory=list)
    unix_time: float = 0.0
    failed: str | None = None  # the run cannot go on (fewer than run.min_workers remain): why
    broken: bool = False  # a member found the generation before broken (a collective of its failed): every wait in
    # that one gives up, even where this one takes nobody out (`Live._superseded`)

    def to_json(self) -> str:
        return json.dumps(self.__dict__)

    @classmethod
    def from_json(cls, text: str | bytes) -> Generation:
        return cls(**json.loads(text))


def why_it_ends(members: list[int], min_workers: int) -> str | None:
    """Why a run whose members are `members` cannot go on, or None. Any member may go: the lowest live one does
    worker 0's duties (fast.runtime.live, fast.runtime.detached)."""
    if len(members) < min_workers:
        return f"{len(members)} workers remain, fewer than run.min_workers = {min_workers}: the run cannot go on"
    return None


def ending_with(members: list[int], last_formed: list[int]) -> list[int]:
    """While the run ends, a new generation's members: nobody comes in, so a joiner whose first group never formed
    is not one of the members that end together (those of `last_formed`, the newest group that formed)."""
    return [m for m in members if m in last_formed]


@dataclass(frozen=True)
class Access:
    """How a process reaches the run's store: its address and the run's secret."""

    host: str
    port: int
    secret: bytes = field(repr=False)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @classmethod
    def parse(cls, address: str, secret: bytes) -> Access:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"the run's membership address {address!r} is not HOST:PORT: give it as in the run's "
                              f"{ADDRESS_FILE}")  # fmt: skip
        return cls(host, int(port), secret)

    @classmethod
    def from_environment(cls) -> Access:
        """A member's access, from what its launcher set: the address, and the file that holds the secret."""
        return cls.parse(os.environ[ADDRESS_VARIABLE], read_secret("a member", Path(os.environ[SECRET_VARIABLE])))

    def environment(self, secret_file: Path) -> dict[str, str]:
        """What a member's process needs to find the run's store (`secret_file` holds this access's secret)."""
        return {ADDRESS_VARIABLE: self.address, SECRET_VARIABLE: str(secret_file)}


def read_secret(command: str, path: Path) -> bytes:
    """The run's secret from `path` (a run's SECRET_FILE); ConfigError naming the fix when it is not one."""
    try:
        secret = bytes.fromhex(path.read_text().strip())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{command}: cannot read the run's secret from {path} ({e}): give the run's "
                          f"{SECRET_FILE}") from None  # fmt: skip
    if len(secret) < 16:
        raise ConfigError(f"{command}: {path} holds {len(secret)} bytes, not a run's secret: give the run's "
                          f"{SECRET_FILE}")  # fmt: skip
    return secret


def connect(access: Access, timeout_s: float) -> RunStore:
    """A connection of its own to the run's store whose waits give up after `timeout_s`; connecting gives up sooner
    (FORM_S: a store that is gone refuses at once)."""
    return RunStore(access.host, access.port, access.secret, timeout_s, connect_s=FORM_S)


def read_key(store: Any, key: str) -> bytes | None:
    return store.get(PREFIX + key) if store.check([PREFIX + key]) else None


def _closed(store: Any) -> bool:
    """Whether the run takes no more changes but departures (closed to joiners, or ending)."""
    return read_key(store, "closed") is not None or read_key(store, "ending") is not None


def config_difference(run: Config, joiner: Config) -> str | None:
    """The first key in which a joiner's config differs from the run's (keys of PER_PROCESS_KEYS aside)."""
    mine, theirs = flat(run.to_dict()), flat(joiner.to_dict())
    for key in sorted(set(mine) | set(theirs)):
        if key in PER_PROCESS_KEYS or mine.get(key) == theirs.get(key):
            continue
        return f"{key} is {theirs.get(key)!r} where the run has {mine.get(key)!r}"
    return None


class Coordinator:
    """The run's membership, kept by its launcher: serves the store, admits joiners, publishes generations. Its
    `deployment` says who founds the run and what it takes; its `config` is what a joiner's must equal, and its
    `loop` (LOOPS) what a joiner must run."""

    def __init__(self, run_dir: Path, config: Config, deployment: Deployment, addr: str, loop: str = "fast") -> None:
        self.run_dir, self.config, self.deployment, self.loop = run_dir, config, deployment, loop
        secret = secrets.token_bytes(32)
        self.server = RunStoreServer(addr, deployment.port, secret)
        self.access = Access(addr, self.server.port, secret)
        self.secret_file = run_dir / SECRET_FILE
        files.write_text(self.secret_file, secret.hex(), private=True)
        files.write_text(run_dir / ADDRESS_FILE, json.dumps({"address": addr, "port": self.server.port}))
        self.store = connect(self.access, 30.0)
        self.shards = deployment.shards  # a replica's processes: its K consecutive ids come and go together
        self.members = list(range(deployment.workers * deployment.shards))  # the founders
        self.pending: list[int] = []  # admitted joiners whose process is not ready to form a group yet
        self.next_id = deployment.processes  # (the ids between the founders and the joiners: the servers)
        self.generation = Generation(0, list(self.members), unix_time=time.time())
        self._exited: dict[int, str] = {}
        self._evicted: dict[int, float] = {}  # member -> when churn told it to leave (unix time)
        self._seen_requests = 0
        self._unwritten_since: float | None = None  # when the next request was counted and found unwritten
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._started = False
        self.writer: int | None = None  # the member that wrote the run's outputs, once wait_for_the_end saw it
        # (`_ask_the_late`) while a generation waits: each member's step as it last reported it, and since when
        self._still: dict[int, tuple[Any, float]] = {}
        self._asked_late: set[int] = set()
        self._looked = 0.0  # (once a second)
        self._publish(self.generation)
        self._thread = threading.Thread(target=self._watch, name="fast-membership", daemon=True)
        self._thread.start()

    def environment(self) -> dict[str, str]:
        """What a founder's process needs to find the membership."""
        return self.access.environment(self.secret_file)

    def started(self) -> bool:
        """Whether a generation's group has formed yet, or worker 0 says it has started (training has started)."""
        if not self._started:
            formed = read_key(self.store, f"settled/{self.generation.number}") == b"formed"
            self._started = formed or read_key(self.store, "started") is not None
        return self._started

    def exited(self, member: int, exit_code: int | None) -> bool:
        """The launcher saw a founder's process end (0: it finished); True if it was told to go (churn)."""
        how = "killed" if exit_code is not None and exit_code < 0 else f"exited with code {exit_code}"
        with self._lock:
            self._exited[member] = how
        return read_key(self.store, f"evict/{member}") is not None

    def holds_state(self, member: int) -> bool:
        """Whether `member` last said it holds the run's state (a joiner: once its heal has landed, which for the
        periodic family is at the end of the round it sits out)."""
        figures = reported_figures(self.store, member)
        return figures is not None and figures.get("holds_state") is True

    def evict(self, member: int, how: str) -> None:
        """Tell `member` to leave (`[faults] churn`): "kill" (it kills itself, a crash) or "term" (SIGTERM); not once
        the run is closed or ending (a member that dies in the end's collectives is survived, but costs the others
        an end over again)."""
        if not _closed(self.store):
            with self._lock:
                self._evicted[member] = time.time()
            self.store.set(PREFIX + f"evict/{member}", how)

    def wait_for_the_end(self) -> bool:
        """Once the launcher's own processes have ended: wait while the run goes on without them (members that
        `fast join` started), until a member has written its outputs (True) or no member is left (False)."""
        store = connect(self.access, 30.0)  # (the watch's connection is its thread's)
        try:
            while not self._closing.is_set():
                written = read_key(store, "written")
                if written is not None:
                    self.writer = int(written) if written.isdigit() else None
                    return True
                generation = self.generation
                ending = read_key(store, "ending") is not None  # (the watch takes nobody in any more)
                gone = {entry["member"] for entry in self._departures(store)}
                if generation.failed or (all(m in gone for m in self.members) and (ending or not self.pending)):
                    return False
                time.sleep(POLL_S * 5)
            return False
        finally:
            store.close()

    def close(self) -> None:
        self._closing.set()
        with contextlib.suppress(RuntimeError):
            self.store.set(PREFIX + "ended", "1")
        self._thread.join(timeout=5)
        self.store.close()
        self.server.close()
        for name in (SECRET_FILE, ADDRESS_FILE):
            (self.run_dir / name).unlink(missing_ok=True)

    def _publish(self, generation: Generation) -> None:
        self.store.set(PREFIX + f"generation/{generation.number}", generation.to_json())
        self.store.set(PREFIX + "generation", str(generation.number))
        self.generation = generation

    def _watch(self) -> None:
        told: set[str] = set()
        while not self._closing.wait(POLL_S * 5):
            try:
                self._round()
            except dist.DistNetworkError:  # the store went away with the run
                return
            except Exception as e:  # a value no member should have written: said once, and the membership goes on
                line = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                if line not in told:
                    told.add(line)
                    print(f"fast: the membership skipped a malformed value ({line})", file=sys.stderr, flush=True)

    def _round(self) -> None:
        ending = read_key(self.store, "ending") is not None
        closed = ending or read_key(self.store, "closed") is not None  # nobody comes in any more; departures count
        left = self._departures(self.store)
        if ending:  # (a member whose end went through leaves as it should)
            left = [entry for entry in left if read_key(self.store, f"done/{entry['member']}") is None]
        if not closed:
            self.pending += self._admissions()
        # a joiner enters a generation once its process is up (starting one takes seconds: the members train on)
        ready = [m for m in self.pending if read_key(self.store, f"ready/{m}") is not None]
        gave_up = [m for m in self.pending if read_key(self.store, f"leave/{m}") is not None]
        k = self.shards  # (a replica enters once all its processes are ready; one gone, the replica is)
        joined = [] if closed else [m for m in ready if all(m // k * k + i in ready for i in range(k))]
        gave_up = [m for m in self.pending if any(g // k == m // k for g in gave_up)]
        joined = [m for m in joined if m not in gave_up]
        self.pending = [m for m in self.pending if m not in joined and m not in gave_up]
        # a member whose collective failed in the newest generation, with no departure to explain it: form it again
        suspected = _count(self.store, f"suspicions/{self.generation.number}") > 0
        if not (left or joined or suspected):
            self._ask_the_late()
            return
        gone = {entry["member"] // k for entry in left}  # (replicas: a process gone takes its replica with it)
        members = [m for m in self.members if m // k not in gone] + sorted(joined)
        if ending and not self.deployment.detached:  # (a detached run forms no group to end with)
            members = ending_with(members, self._last_formed().members)
        self.members = members
        failed = why_it_ends(members[::k], self.deployment.min_workers)
        self._publish(Generation(self.generation.number + 1, members, joined, left, time.time(), failed, suspected))

    def _last_formed(self) -> Generation:
        """The newest generation whose group formed (the founders' if none has yet)."""
        for number in range(self.generation.number, 0, -1):
            if read_key(self.store, f"settled/{number}") == b"formed":
                return Generation.from_json(self.store.get(PREFIX + f"generation/{number}"))
        return Generation.from_json(self.store.get(PREFIX + "generation/0"))

    def _ask_the_late(self) -> None:
        """While the newest generation waits for its members: one that has not arrived a third of run.deadline_s
        after it was published, its step standing still as long (a member between its steps arrives at its next
        change point; one whose step does not move is held somewhere), is asked once for its threads' stacks, which
        it writes beside its records (`Member.on_late`), and named on stderr: a stall says where it is."""
        generation, now = self.generation, time.time()
        if now - self._looked < 1.0 or generation.number == 0:  # (the founders' start: `Live._watched` keeps it)
            return
        self._looked = now
        if read_key(self.store, f"settled/{generation.number}") is not None:
            self._still = {}
            return
        patience_s = self.config.run.deadline_s / 3
        for member in generation.members:
            step = (reported_figures(self.store, member) or {}).get("step")
            was, since = self._still.get(member, (step, now))
            self._still[member] = (step, since if step == was else now)
            if (member in self._asked_late or now - generation.unix_time < patience_s
                    or now - self._still[member][1] < patience_s
                    or read_key(self.store, f"arrived/{generation.number}/{member}") is not None):  # fmt: skip
                continue
            self._asked_late.add(member)
            self.store.set(PREFIX + f"late/{member}", str(generation.number))
            stacks = self.run_dir / "workers" / f"late-{member}.txt"
            print(f"fast: generation {generation.number} has waited {now - generation.unix_time:.0f}s for worker "
                  f"{member}, whose step has not moved: its threads' stacks go to {stacks}", file=sys.stderr,
                  flush=True)  # fmt: skip

    def _departures(self, store: Any) -> list[dict[str, Any]]:
        """The members that have gone (as read through `store`): how each went, and when churn told it to go
        (`evicted_unix_time`: it goes within a heartbeat of that)."""
        now, left = time.time(), []
        with self._lock:
            exited, evicted = dict(self._exited), dict(self._evicted)
        for member in self.members:
            said = read_key(store, f"leave/{member}")
            silent_s = now - beat_time(read_key(store, f"heartbeat/{member}"), now)
            if said is not None:
                how = said.decode(errors="replace")[:200]
            elif member in exited:
                how = exited[member]
            elif silent_s > SILENT_S:
                how = f"silent for {silent_s:.0f}s"
            else:
                continue
            entry = {"member": member, "how": how}
            if member in evicted:
                entry["evicted_unix_time"] = evicted[member]
            left.append(entry)
        return left

    def _admissions(self) -> list[int]:
        """Answer each new join request: a member id, or why not. A request counted but left unwritten past SLOT_S
        (its writer died between the two) is skipped."""
        admitted = []
        requests = _count(self.store, "requests")
        while self._seen_requests < requests:
            number = self._seen_requests + 1
            written = read_key(self.store, f"request/{number}")
            if written is None:
                self._unwritten_since = self._unwritten_since or time.monotonic()
                if time.monotonic() - self._unwritten_since < SLOT_S:
                    break  # counted, not written yet: the next round
            self._unwritten_since = None
            self._seen_requests = number
            if written is None:
                continue
            reason = self._refusal(written, len(self.members) + len(admitted))
            if reason is None:  # (a sharded run's joiner is a replica: K ids, one a process)
                member, self.next_id = self.next_id, self.next_id + self.shards
                admitted += range(member, self.next_id)
                answer = {"member": member}
            else:
                answer = {"refused": reason}
            self.store.set(PREFIX + f"answer/{number}", json.dumps(answer))
        return admitted

    def _refusal(self, written: bytes, size: int) -> str | None:
        """Why the join request `written` is refused (None: admitted); any malformed request is one refusal."""
        from fast.assemble import load_config

        try:
            request = json.loads(written)
            joiner = load_config(json.loads(request["config"]))
        except (ConfigError, ValueError, KeyError, TypeError, RecursionError) as e:
            return f"its request is not valid: {type(e).__name__}: {str(e)[:200]}"
        loop = request["loop"] if "loop" in request else "fast"  # (a joiner of an older FAST: its own loop)
        if loop != self.loop:
            theirs = LOOPS.get(loop, "a loop FAST does not know")
            where = (": join it with its script, `fast join RUN_DIR` on its launcher's machine or `fast join --address "
                     "--token-file --script SCRIPT -- ARGS` on another") if self.loop == "script" else ""  # fmt: skip
            return f"it would train {theirs} where the run trains {LOOPS[self.loop]}{where}"
        # (a script's joiner runs the founders' script with their settings, and so takes its config as they did from
        # the script's fast.init, of which the launcher's `config` is only the part it was given: nothing to compare)
        difference = config_difference(self.config, joiner) if loop != "script" else None
        if difference is not None:
            return f"its config differs from the run's: {difference}"
        limit = self.deployment.max_workers or 256
        if (size + len(self.pending)) // self.shards >= limit:  # (a sharded run's workers are replicas of K)
            return f"the run already has {size // self.shards} workers, its run.max_workers: try again when one leaves"
        return None


def _count(store: Any, key: str) -> int:
    """The counter `key` (0 if none yet)."""
    return int(store.add(PREFIX + key, 0))


def beat_time(written: bytes | None, now: float) -> float:
    """The time of a heartbeat as a member wrote it; `now` when there is none, or it is not a time."""
    try:
        beat = float(written) if written is not None else now
    except ValueError:
        return now
    return beat if beat == beat else now  # (NaN)


class Member:
    """A worker's side of the membership: its id, heartbeats, and the generations the coordinator publishes."""

    def __init__(self, access: Access, member: int, deadline_s: float) -> None:
        self.access, self.id, self.deadline_s = access, member, deadline_s
        try:
            self.store = connect(access, deadline_s)
        except RuntimeError:  # the launcher and its store are gone
            raise RunEnded(f"the run's membership at {access.address} does not answer: the run has ended") from None
        self._stop = threading.Event()
        self._asked_to_stop = False  # `fast stop`, as the heartbeat last read it (off the training step's path)
        self._ending = False  # the run is ending, as the heartbeat last read it
        self._in_the_run = False  # a group of this member's has formed (not a joiner still on its way in)
        self._figures: Callable[[], dict[str, Any]] | None = None
        self._late: Callable[[], Any] | None = None  # (`on_late`) what it does, once, when the coordinator asks
        self._group_connection: RunStore | None = None
        self._generations: dict[int, Generation] = {}
        self._beats = threading.Thread(target=self._beat, name="fast-heartbeat", daemon=True)
        self._beats.start()

    def _beat(self) -> None:
        try:
            store = connect(self.access, self.deadline_s)  # a connection of its own
        except RuntimeError:  # the run's launcher is gone: the lifeline ends this process
            return
        while True:
            try:
                store.set(PREFIX + f"heartbeat/{self.id}", repr(time.time()))
                if self._figures is not None:
                    store.set(PREFIX + f"figures/{self.id}", json.dumps(self._figures()))
                evicted = read_key(store, f"evict/{self.id}")
                late = self._late is not None and read_key(store, f"late/{self.id}") is not None
                self._asked_to_stop = self._asked_to_stop or bool(store.check([PREFIX + "stopping"]))
                self._ending = self._ending or bool(store.check([PREFIX + "ending"]))
            except Exception:  # the run's launcher is gone: the lifeline ends this process
                return
            if late:  # (once)
                dump, self._late = self._late, None
                with contextlib.suppress(OSError):
                    dump()
            if evicted is not None and not _closed(store):  # [faults] churn: a crash, or SIGTERM
                os.kill(os.getpid(), signal.SIGKILL if evicted == b"kill" else signal.SIGTERM)
                return
            if self._stop.wait(HEARTBEAT_S):
                return

    def ready(self) -> None:
        """A joiner's process is up: the coordinator puts it in the next generation."""
        self.store.set(PREFIX + f"ready/{self.id}", "1")

    def newest(self) -> int:
        return int(self.store.get(PREFIX + "generation"))

    def generation(self, number: int) -> Generation:
        """Generation `number` (published once, never changed: read from the store once)."""
        if number not in self._generations:
            self._generations[number] = Generation.from_json(self.store.get(PREFIX + f"generation/{number}"))
        return self._generations[number]

    def wait_for(self, after: int, *, including: int | None = None) -> Generation:
        """The first generation newer than `after` (that has `including` among its members, if given)."""
        start = time.monotonic()
        while True:
            newest = self.newest()
            if newest > after:
                generation = self.generation(newest)
                if generation.failed:
                    raise RunEnded(generation.failed)
                if including is None or including in generation.members:
                    return generation
                after = newest
            # (while the run ends, a member of it waits on for the generation without one that died meanwhile)
            ending = (including is not None or not self._in_the_run) and read_key(self.store, "ending") is not None
            if ending or read_key(self.store, "ended") is not None:
                raise RunEnded("the run ended before this worker could take part again")
            if time.monotonic() - start > self.deadline_s:
                raise RunEnded(f"no new membership within run.deadline_s = {self.deadline_s:g}s")
            time.sleep(POLL_S)

    def arrive(self, generation: Generation) -> bool:
        """Wait until every member of `generation` has arrived to form its group: True, and every member forms it;
        or False, and none does (a newer generation came first, a member never came, or the run is ending without
        this joiner). The first member to see either settles it for all, by compare-and-set."""
        formed = self._settle(generation)
        self._in_the_run = self._in_the_run or formed
        return formed

    def _settle(self, generation: Generation) -> bool:
        key, settled = PREFIX + f"arrived/{generation.number}", PREFIX + f"settled/{generation.number}"
        if read_key(self.store, f"settled/{generation.number}") is None:
            self.store.set(PREFIX + f"arrived/{generation.number}/{self.id}", "1")  # (who: `_ask_the_late`)
            self.store.add(key, 1)
        start = time.monotonic()
        while True:
            decided = read_key(self.store, f"settled/{generation.number}")
            if decided is not None:
                return decided == b"formed"
            if int(self.store.add(key, 0)) >= len(generation.members):
                outcome = "formed"
            elif (self.newest() > generation.number or time.monotonic() - start > self.deadline_s
                  or (self._ending and not self._in_the_run)):  # fmt: skip
                outcome = "abandoned"
            else:
                time.sleep(POLL_S)
                continue
            return self.store.compare_set(settled, "", outcome) == b"formed"

    def group_store(self, generation: Generation, interrupted: Callable[[], str | None] | None = None) -> Any:
        """The store `generation`'s group forms on: its own prefix, and a connection whose waits give up after
        FORM_S, or as soon as `interrupted()` says why (a member that died between arriving and forming does not
        hold the others up: the generation without it is published meanwhile)."""
        if self._group_connection is not None:  # the last group's: aborted before a new one forms
            self._group_connection.close()
        self._group_connection = connect(self.access, min(self.deadline_s, FORM_S))
        self._group_connection.interrupted = interrupted
        return self._group_connection.for_group(PREFIX + f"group/{generation.number}/")

    def form(self, generation: Generation, device: torch.device, deadline_s: float, counter: Any, make_comm: Any,
             interrupted: Callable[[], str | None] | None = None) -> Comm:  # fmt: skip
        """This member's Comm over `generation`'s group (collective over its members; RuntimeError if one
        does not come within FORM_S, or once `interrupted()` says why)."""
        n, rank = len(generation.members), generation.members.index(self.id)
        return engine.start_group(self.group_store(generation, interrupted), rank, n, device, deadline_s, counter,
                                  make_comm, FORM_S)  # fmt: skip

    def suspect(self, generation: int) -> None:
        """A collective of this member's in `generation` failed: ask the coordinator to form it again, unless a
        newer generation (a departure it saw) has already replaced it."""
        self.store.add(PREFIX + f"suspicions/{generation}", 1)

    def stopping(self) -> bool:
        """Whether `fast stop` asked the run to end (the members end together at their next boundary); read by the
        heartbeat every HEARTBEAT_S, so that a step asks the store nothing more."""
        return self._asked_to_stop

    def ending_seen(self) -> bool:
        """Whether worker 0 has ended the run (read by the heartbeat, like `stopping`)."""
        return self._ending

    def started(self) -> None:
        """Worker 0 has started training (for a run whose members form no group until the end): when, on the wall
        clock, from which a joiner's run time counts."""
        self.store.set(PREFIX + "started", repr(time.time()))

    def on_late(self, late: Callable[[], Any]) -> None:
        """Call `late()` on the heartbeat's thread, once, when the coordinator finds a generation waiting for this
        member while its step stands still (`Coordinator._ask_the_late`)."""
        self._late = late

    def report(self, figures: Callable[[], dict[str, Any]]) -> None:
        """Leave `figures()` (JSON) in the store with each heartbeat and on leaving: what the run's summary counts of
        this member if it is gone by the end (its bytes, its samples)."""
        self._figures = figures

    def figures_of(self, member: int) -> dict[str, Any] | None:
        """What `member` last reported (None: nothing)."""
        return reported_figures(self.store, member)

    def leave(self, how: str) -> None:
        try:
            if self._figures is not None:
                self.store.set(PREFIX + f"figures/{self.id}", json.dumps(self._figures()))
            self.store.set(PREFIX + f"leave/{self.id}", how)
        except Exception:
            pass
        self.close()

    def note_change(self, change: dict[str, Any]) -> None:
        """The member that does worker 0's duties notes a change of membership as the run's summary lists it (kept
        in the store, so that the next one to do them, if this one dies, has every change)."""
        number = int(self.store.add(PREFIX + "changes", 1))
        self.store.set(PREFIX + f"change/{number}", json.dumps(change))

    def changes(self, last: bool = False) -> list[dict[str, Any]]:
        """The changes noted so far, in order (`last`: only the newest); one that is not a change is skipped."""
        count = _count(self.store, "changes")
        found = []
        for number in range(count, 0, -1) if last else range(1, count + 1):
            try:
                change = json.loads(read_key(self.store, f"change/{number}") or b"null")
            except ValueError:
                change = None
            if isinstance(change, dict) and isinstance(change.get("members"), list):
                found.append(change)
                if last:
                    break
        return found

    def wrote(self) -> None:
        """The outputs are written (by this member): the launcher's run has ended well, whoever died."""
        self.store.set(PREFIX + "written", str(self.id))

    def close_to_joiners(self) -> None:
        """The member that does worker 0's duties is out of time while the members re-form: nobody else comes in,
        churn stops (departures still make new generations), so that the members can form one last time and end."""
        self.store.set(PREFIX + "closed", "1")

    def ending(self) -> None:
        """The run is ending (its members have taken their last step): nobody else is admitted."""
        self.store.set(PREFIX + "ending", "1")

    def done(self) -> None:
        """This member's end went through: its process may exit, and while the run ends that is no departure."""
        self.store.set(PREFIX + f"done/{self.id}", "1")

    def close(self) -> None:
        self._stop.set()


def reported_figures(store: Any, member: int) -> dict[str, Any] | None:
    """What `member` last left in the store (`Member.report`), if it is well formed (None: nothing)."""
    text = read_key(store, f"figures/{member}")
    try:
        figures = json.loads(text) if text is not None else None
    except ValueError:
        return None
    return figures if isinstance(figures, dict) and isinstance(figures.get("counter"), dict | None) else None


def report_left(access: Access, member: int, how: str) -> None:
    """A joiner's launcher saw its worker end: the coordinator drops it now, not at the end of its heartbeats."""
    try:
        connect(access, 5).set(PREFIX + f"leave/{member}", how)
    except RuntimeError:  # the run is over
        pass


def _reach(command: str, access: Access, timeout_s: float) -> RunStore:
    """A connection to a live run's store, for a request of `command` (fast join, fast stop)."""
    try:
        store = connect(access, timeout_s)
    except StoreRefused:
        raise Refused(f"{command}: refused: it does not hold the run's secret: give `{command}` the run folder, or "
                      f"--token-file with the run's {SECRET_FILE}") from None  # fmt: skip
    except RuntimeError as e:
        raise ConfigError(f"{command}: no run answers at {access.address} ({str(e).splitlines()[0]}): check the "
                          "address and that the run is still going") from None  # fmt: skip
    if read_key(store, "ended") is not None or read_key(store, "ending") is not None:
        raise RunEnded(f"the run at {access.address} has ended: there is nothing to {command.split()[-1]}")
    return store


def request_admission(access: Access, config: Config, timeout_s: float, loop: str = "fast") -> int:
    """A joiner's request to train `loop` (LOOPS) on `config`: its member id, or Refused naming why."""
    store = _reach("fast join", access, timeout_s)
    number = int(store.add(PREFIX + "requests", 1))
    store.set(PREFIX + f"request/{number}", json.dumps({"config": json.dumps(config.to_dict()), "loop": loop}))
    start = time.monotonic()
    while (answer := read_key(store, f"answer/{number}")) is None:
        if time.monotonic() - start > timeout_s:
            raise RunEnded(f"the run did not answer the join request within {timeout_s:g}s")
        time.sleep(POLL_S)
    decided = json.loads(answer)
    if "refused" in decided:
        raise Refused(f"fast join: refused: {decided['refused']}")
    return int(decided["member"])


def request_stop(access: Access, timeout_s: float = 30.0) -> None:
    """`fast stop`: ask a live run to end, its members together at their next boundary (their heartbeats read
    it); Refused naming why not."""
    _reach("fast stop", access, timeout_s).set(PREFIX + "stopping", "1")
