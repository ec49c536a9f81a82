"""Messages between asynchronous workers: a listener thread, and sends and waits that outlive a dead peer.

The strategies whose workers talk whenever they like (async-broadcast, ad-psgd, push-sum, the master of
asynchronous EASGD) move (header, body) messages on a `Mailbox` of their own, received in the background by
a `Listener`. A header is a float64 vector whose first entry is MESSAGE, DONE or MARKER; a MESSAGE header is
followed by a float32 body, a MARKER header (a checkpoint marker) by nothing; a pair's messages arrive in the
order they were sent, so after a sender's DONE nothing more comes from it.

Dead peers. An operation with a given peer fails at once when that peer's process is gone (its connection
is closed); a receive from any peer does not. A `Mailbox` is a `fast.comm.patience.PatientGroup`: its waits
give up at the run's deadline without breaking gloo, and its `probe` finds a dead peer without waiting.
`Listener.finish`, which waits for DONE from every sender, probes the senders it still waits for. A peer
whose connection closed, or that did not answer within the deadline, is dead to the caller, which records it
once and stops sending to it.

Lost messages. On an emulated lossy link (`[network] loss`) a body sent with `droppable=True` may be lost.
Its header, a few bytes saying who sent what (a step, a weight), is sent reliably, so the listener always
knows that a message came and from whom, and hands the strategy None for a lost body.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from fast.comm import timing
from fast.comm.comm import Handle, MessageLost
from fast.comm.patience import PatientGroup, wait_for_senders
from fast.errors import CommError

MESSAGE, DONE, MARKER = 0.0, 1.0, 2.0


class Mailbox(PatientGroup):
    """A strategy's message channel: (header, body) messages over a `PatientGroup`."""

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


class Listener:
    """Receives (header, body) messages in the background until every expected sender has said DONE.

    Each message goes to `on_message(sender, header, body)` in this thread; `body` is None when it was lost
    on a lossy emulated link. A sender that dies between its header and its body goes to `on_gone(sender,
    why)`. A marker (`Mailbox.send_marker`) goes to `on_marker(sender, header)`, in this thread too, in its
    place among the sender's messages. A listener may rightly hear nothing for a long time (rare pushes, a
    neighbour evaluating), so its receives have no deadline of their own; `finish` puts one on the wait for
    the senders' DONE.
    """

    def __init__(
        self,
        mailbox: Mailbox,
        senders: Iterable[int],
        header_size: int,
        body_numel: int,
        on_message: Callable[[int, torch.Tensor, torch.Tensor | None], None],
        on_gone: Callable[[int, str], None],
        tag: int = 0,
        on_marker: Callable[[int, torch.Tensor], None] | None = None,
    ) -> None:
        self.mailbox = mailbox
        self.header_size, self.body_numel = header_size, body_numel
        self.on_message, self.on_gone, self.tag = on_message, on_gone, tag
        self.on_marker = on_marker
        self.waiting = set(senders)
        self.received = dict.fromkeys(self.waiting, 0)  # messages whose header arrived (the body may be lost)
        self.lost = dict.fromkeys(self.waiting, 0)  # of those, the ones whose body was lost on its link
        self.heard: dict[int, float] = {}  # timing.now() of each sender's last message
        self.done_headers: dict[int, torch.Tensor] = {}  # the training thread reads it: who has finished
        self.error: BaseException | None = None
        self.changed = timing.Condition()  # notified whenever a sender is heard from
        self.thread = timing.Thread(self.run, "fast-listener")

    def start(self) -> None:
        self.thread.start()

    def run(self) -> None:
        try:
            while self.waiting:
                header = torch.zeros(self.header_size, dtype=torch.float64)
                sender = self.mailbox.comm.recv_from(header, tag=self.tag)  # no deadline: see the docstring
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
                    self.mailbox.comm.recv(body, sender, tag=self.tag + 1)  # it follows its header at once
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
            self.heard[sender] = timing.now()
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
        while are probed (fast.comm.patience.wait_for_senders); one found dead goes to `found_dead`, which must
        add it to `dead`. Senders found dead are not waited for; this thread then goes on listening, harmlessly."""
        wait_for_senders(self.changed, lambda: sorted(self.waiting - dead), self.heard, self.mailbox.probe,
                         found_dead, self.mailbox.deadline_s, self.check)  # fmt: skip
