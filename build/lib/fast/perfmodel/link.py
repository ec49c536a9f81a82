"""The α-β link model: a message of n bytes takes α + n/β seconds (Ben-Nun and Hoefler 2019 Sec. 2.5, Langer et al.
2020 Sec. 3.4.1).

α is the link's latency (seconds per message) and β its bandwidth (bytes per second). A NIC sends one
message at a time, so k messages from the same worker take k·(α + n/β); links of different workers
work in parallel and in both directions at once (full duplex).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fast.errors import ConfigError
from fast.units import parse_bandwidth, parse_duration


@dataclass(frozen=True)
class Link:
    """A point-to-point link: `latency_s` (α) seconds per message, `bandwidth_Bps` (β) bytes per second."""

    latency_s: float
    bandwidth_Bps: float

    def __post_init__(self) -> None:
        if not math.isfinite(self.latency_s) or self.latency_s < 0:
            raise ConfigError(f"link latency {self.latency_s!r} s must be finite and >= 0: e.g. 0.02 for 20 ms")
        if not math.isfinite(self.bandwidth_Bps) or self.bandwidth_Bps <= 0:
            raise ConfigError(
                f"link bandwidth {self.bandwidth_Bps!r} B/s must be finite and > 0: e.g. 2.5e6 for 20 Mbit"
            )

    @classmethod
    def parse(cls, latency: str | float, bandwidth: str | float) -> Link:
        """A link from config strings, e.g. `Link.parse("20ms", "20Mbit")`."""
        return cls(latency_s=parse_duration(latency), bandwidth_Bps=parse_bandwidth(bandwidth))

    def message_time(self, nbytes: float) -> float:
        """Seconds to send one message of `nbytes` bytes: α + n/β."""
        return self.latency_s + nbytes / self.bandwidth_Bps
