"""Termination signals handled as Ctrl-C is: SIGTERM and SIGHUP to a launcher raise `Stopped` where Ctrl-C raises
KeyboardInterrupt (of which it is a kind), so that every process is stopped, what was written is kept, and the exit
code is a shell's: 128 + the signal's number. Where an interrupt would leave something half done (an import, a
process half started), `held_interrupts` holds them back until it is done."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any


class Stopped(KeyboardInterrupt):
    """A termination signal (SIGTERM, SIGHUP) to the launcher: raised where Ctrl-C raises KeyboardInterrupt, and
    handled as it is."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


TERMINATION_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
INTERRUPTS = (signal.SIGINT, *TERMINATION_SIGNALS)


@contextlib.contextmanager
def stopped_on_termination() -> Iterator[None]:
    """In a launcher's main thread, meanwhile: SIGTERM and SIGHUP raise Stopped. The handlers there were come back
    after it: one that raised while the process exits would raise into its atexit callbacks (a traceback of torch's
    finalizers), where the signal's own end is what the sender asked for."""

    def stop(signum: int, frame: Any) -> None:
        raise Stopped(signum)

    previous = {number: signal.getsignal(number) for number in TERMINATION_SIGNALS}
    for number in TERMINATION_SIGNALS:
        signal.signal(number, stop)
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def how_interrupted(interrupt: BaseException) -> tuple[str, int]:
    """("Ctrl-C", 130) or ("SIGTERM", 143): what interrupted the launcher, and the exit code a shell would give."""
    signum = interrupt.signum if isinstance(interrupt, Stopped) else signal.SIGINT
    return ("Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name), 128 + signum


@contextlib.contextmanager
def held_interrupts() -> Iterator[None]:
    """Ctrl-C, SIGTERM and SIGHUP held back meanwhile, and delivered again as it ends (to the handlers there were
    before). The same signal a second time is not held: the user who presses Ctrl-C twice means now, and an import
    that never ends can still be stopped. Outside the main thread, where Python handles no signal, nothing is held."""
    held: list[int] = []
    previous: dict[int, Any] = {}

    def hold(number: int, frame: Any) -> None:
        if number in held and callable(previous.get(number)):
            held.remove(number)
            previous[number](number, frame)
        held.append(number)

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    try:  # (a signal handled while the handlers are put in place raises there: the finally puts every one back)
        for number in INTERRUPTS:
            previous[number] = signal.signal(number, hold)
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
        for number in dict.fromkeys(held):
            signal.raise_signal(number)
