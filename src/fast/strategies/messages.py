"""Messages between asynchronous workers: a listener thread, and sends and waits that outlive a dead peer.

The strategies whose workers talk whenever they like (async-broadcast, ad-psgd, push-sum, the master of
asynchronous EASGD) move (header, body) messages on a `Channel` of their own, received in the background by
a `Listener`. A header is a float64 vector whose first entry is MESSAGE, DONE or MARKER; a MESSAGE header is
followed by a float32 body, a MARKER header (a checkpoint marker) by nothing; a pair's messages arrive in the
order they were sent, so after a sender's DONE nothing more comes from it.

Dead peers. An operation with a given peer fails at once when that peer's process is gone (its connection
is closed); a receive from any peer does not. A `Channel` is a `fast.comm.channel.PatientChannel`: its waits
give up at the run's deadline without breaking gloo, and its `probe` finds a dead peer without waiting.
`Listener.finish`, which waits for DONE from every sender, probes the senders it still waits for. A peer
whose connection closed, or that did not answer within the deadline, is dead to the caller: `PeerDeaths`
records it once (`Strategy.lost`) and the strategy stops sending to it.

Lost messages. On an emulated lossy link (`[network] loss`) a body sent with `droppable=True` may be lost.
Its header, a few bytes saying who sent what (a step, a weight), is sent reliably, so the listener always
knows that a message came and from whom, and hands the strategy None for a lost body.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

import torch

from fast.comm import Handle, MessageLost
from fast.comm.channel import PatientChannel, probe_period
from fast.comm.waiting import waiting
from fast.errors import CommError
from fast.strategies.base import Strategy, StrategyContext
from fast.strategies.gossip import PeerOptions, RandomPeers

MESSAGE, DONE, MARKER = 0.0, 1.0, 2.0


class Channel(PatientChannel):
    """A strategy's message channel: (header, body) messages over a `PatientChannel`."""

    def post_message(
        self, peer: int, header: list[float], body: torch.Tensor, tag: int = 0, droppable: bool = False
    ) -> list[Handle]:
        """Start sending one message: the header [MESSAGE, *header] on `tag`, reliably, then `body` as float32
        on `tag + 1` (lost on a lossy emulated link now and then when `droppable`). `wait` on the handles
        before changing `body`. Raises CommError when `peer` is known to be gone."""
        header_tensor = torch.tensor([MESSAGE, *header], dtype=torch.float64)
        body = body.detach().to("cpu", torch.float32).contiguous()
        return [
            self.comm.isend(header_tensor, peer, tag=tag),
            self.comm.isend(body, peer, tag=tag + 1, droppable=droppable),
        ]

    def send_message(
        self, peer: int, header: list[float], body: torch.Tensor, tag: int = 0, droppable: bool = False
    ) -> None:
        """`post_message`, then wait until it has left. Raises CommError when `peer` is gone or stuck."""
        for handle in self.post_message(peer, header, body, tag, droppable):
            self.wait(handle)

    def send_done(self, peer: int, header: list[float], tag: int = 0) -> None:
        """Tell `peer` that no message follows (a header [DONE, *header] and no body)."""
        self.send(torch.tensor([DONE, *header], dtype=torch.float64), peer, tag)

    def send_marker(self, peer: int, header: list[float], tag: int = 0) -> None:
        """Send `peer` a marker behind this sender's messages (a header [MARKER, *header] and no body)."""
        self.send(torch.tensor([MARKER, *header], dtype=torch.float64), peer, tag)


class Listener(threading.Thread):
    """Receives (header, body) messages in the background until every expected sender has said DONE.

    Each message goes to `on_message(sender, header, body)` in this thread; `body` is None when it was lost
    on a lossy emulated link. A sender that dies between its header and its body goes to `on_gone(sender,
    why)`. A marker (`Channel.send_marker`) goes to `on_marker(sender, header)`, in this thread too, in its
    place among the sender's messages. A listener may rightly hear nothing for a long time (rare pushes, a
    neighbour evaluating), so its receives have no deadline of their own; `finish` puts one on the wait for
    the senders' DONE.
    """

    def __init__(
        self,
        channel: Channel,
        senders: Iterable[int],
        header_size: int,
        body_numel: int,
        on_message: Callable[[int, torch.Tensor, torch.Tensor | None], None],
        on_gone: Callable[[int, str], None],
        tag: int = 0,
        on_marker: Callable[[int, torch.Tensor], None] | None = None,
    ) -> None:
        super().__init__(name="fast-listener", daemon=True)
        self.channel = channel
        self.header_size, self.body_numel = header_size, body_numel
        self.on_message, self.on_gone, self.tag = on_message, on_gone, tag
        self.on_marker = on_marker
        self.waiting = set(senders)
        self.received = dict.fromkeys(self.waiting, 0)  # messages whose header arrived (the body may be lost)
        self.lost = dict.fromkeys(self.waiting, 0)  # of those, the ones whose body was lost on its link
        self.heard = dict.fromkeys(self.waiting, 0.0)  # time.monotonic() of each sender's last message
        self.done_headers: dict[int, torch.Tensor] = {}  # the training thread reads it: who has finished
        self.error: BaseException | None = None
        self.changed = threading.Condition()  # notified whenever a sender is heard from

    def run(self) -> None:
        try:
            while self.waiting:
                header = torch.zeros(self.header_size, dtype=torch.float64)
                sender = self.channel.comm.recv_from(header, tag=self.tag)  # no deadline: see the docstring
                if header[0].item() == DONE:
                    self._heard(sender, done=header)
                    continue
                if header[0].item() == MARKER:  # no body follows
                    if self.on_marker is not None:
                        self.on_marker(sender, header)
                    self._heard(sender)
                    continue
                body: torch.Tensor | None = torch.empty(self.body_numel)
                try:
                    self.channel.comm.recv(body, sender, tag=self.tag + 1)  # it follows its header at once
                except MessageLost:
                    body = None
                    self.lost[sender] += 1
                except CommError as e:  # it died between its header and its body
                    self.on_gone(sender, str(e))
                    self._heard(sender, done=None, gone=True)
                    continue
                self.received[sender] += 1
                self.on_message(sender, header, body)
                self._heard(sender)
        except BaseException as e:  # handed to the training thread by check() and finish()
            self.error = e
            with self.changed:
                self.changed.notify_all()

    def _heard(self, sender: int, done: torch.Tensor | None = None, gone: bool = False) -> None:
        with self.changed:
            self.heard[sender] = time.monotonic()
            if done is not None:
                self.done_headers[sender] = done
            if done is not None or gone:
                self.waiting.discard(sender)
            self.changed.notify_all()

    def check(self) -> None:
        """Raise in the training thread what went wrong in this one."""
        if self.error is not None:
            raise self.error

    def finish(self, dead: set[int], found_dead: Callable[[int, str], None]) -> None:
        """Wait until every sender not in `dead` has said DONE. The senders still awaited and silent for a
        while are probed: one whose connection is closed, or that stays silent for the deadline (counted from
        its last message or from this call, whichever is later), goes to `found_dead`, which must add it to
        `dead`. Senders found dead are not waited for; this thread then goes on listening, harmlessly."""
        start, deadline_s = time.monotonic(), self.channel.deadline_s
        period = probe_period(deadline_s)
        probed: dict[int, float] = {}
        with waiting(), self.changed:
            while True:
                self.check()
                missing = sorted(self.waiting - dead)
                if not missing:
                    return
                now = time.monotonic()
                for sender in missing:
                    silent = now - max(start, self.heard[sender])
                    if silent < period or now - probed.get(sender, start) < period:
                        continue
                    probed[sender] = now
                    why = self.channel.probe(sender)
                    if why is None and silent > deadline_s:
                        why = f"silent for {silent:.1f}s while this worker waited for it to finish"
                    if why is not None:
                        found_dead(sender, why)
                self.changed.wait(period)


class PeerDeaths:
    """The peers a worker finds dead, from its training thread or its listener, each recorded once with
    `Strategy.lost`. The step recorded is the last one the dead peer was heard to have done (its messages
    carry their step), else this worker's own step. `forget(peer)` then drops it from whom the strategy
    contacts."""

    def __init__(self, strategy: Strategy, forget: Callable[[int], None] = lambda peer: None) -> None:
        self.strategy, self.forget = strategy, forget
        self.lock = threading.Lock()
        self.heard: dict[int, int] = {}  # peer -> the steps it had done when it last sent something
        self.own_step = 0  # steps this worker has done

    def found(self, peer: int, how: str) -> None:
        with self.lock:
            if peer in self.strategy.dead:
                return
            self.strategy.lost(peer, self.heard.get(peer, self.own_step), how)
            self.forget(peer)


class LivePeers(RandomPeers):
    """`RandomPeers` without the peers found dead: dead neighbours are never chosen, and a schedule is re-made
    over the live workers (`PeerSchedule.without`)."""

    def __init__(self, options: PeerOptions, ctx: StrategyContext) -> None:
        super().__init__(options, ctx)
        self.dead: set[int] = set()

    def forget(self, peer: int) -> None:
        self.dead.add(peer)
        if self.schedule is not None:
            self.schedule = self.schedule.without([self.ranks.index(peer)])

    def targets(self, step: int) -> list[int]:
        if not self.dead or self.schedule is not None:
            return super().targets(step)
        if torch.rand((), generator=self.generator).item() >= self.probability:
            return []
        neighbours = [j for j in self.topology.neighbors(self.me) if self.ranks[j] not in self.dead]
        chosen = torch.randperm(len(neighbours), generator=self.generator)[: self.count]
        return [self.ranks[neighbours[int(k)]] for k in chosen]
