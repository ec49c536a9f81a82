"""Order predicted variants by time per epoch: the number of epochs each needs is not known in advance."""

from __future__ import annotations

from collections.abc import Mapping

from fast.errors import ConfigError
from fast.perfmodel.step import StepCost


def rank_by_epoch_time(costs: Mapping[str, StepCost], steps_per_epoch: int | Mapping[str, int]) -> list[str]:
    """Variant names, fastest epoch first: time_s × steps per epoch (one number, or one per variant).

    The epochs each variant needs to reach an accuracy are unknown beforehand, so this ranks time per
    epoch, not time to accuracy. Ties keep name order.
    """
    steps = steps_per_epoch if isinstance(steps_per_epoch, Mapping) else dict.fromkeys(costs, steps_per_epoch)
    missing = sorted(set(costs) - set(steps))
    if missing:
        raise ConfigError(f"steps_per_epoch has no entry for {', '.join(missing)}: give one for every variant")
    return sorted(costs, key=lambda name: (costs[name].time_s * steps[name], name))
