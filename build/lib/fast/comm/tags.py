"""The registry of message tags: the tags FAST's own layers send on, in one place, and the check that a strategy's
tags stay clear of them. A strategy picks its own small tags (one strategy runs per group, so strategies may
reuse each other's) and declares them (`Strategy.tags`); registering the class checks them here."""

from __future__ import annotations

PROBE = 99  # comm.patience: a send nobody receives, to find a dead peer
END_OF_RUN = 7_001  # runtime: the end of a run that survives failures, point to point to worker 0
AGREE = 7_002  # runtime: the workers' decisions taken together, through worker 0
LAYOUT = 7_003  # runtime: worker 0 tells each server the model's layout
COLLECTIVE = 0x3F000000  # emulation: the rounds of emulated collectives

RESERVED = {PROBE: "probes", END_OF_RUN: "the end of the run", AGREE: "decisions", LAYOUT: "the model's layout",
            COLLECTIVE: "emulated collectives"}  # fmt: skip


def check(owner: str, tags: tuple[int, ...]) -> None:
    """ValueError when one of `owner`'s tags is one FAST reserves."""
    for tag in tags:
        if tag in RESERVED:
            raise ValueError(f"{owner} sends on tag {tag}, which FAST uses for {RESERVED[tag]}: choose another tag")
