"""The α-β cost model: predict step time and traffic of each strategy on given links, before training.

`Link` is a link (latency α, bandwidth β); `allreduce_cost` prices one all-reduce per algorithm;
`fast.perfmodel.step` holds the pieces each strategy prices its step with (`Strategy.cost`);
`flops_per_sample` and `compute_communication_ratio` describe the model; `rank_by_epoch_time` orders variants
by predicted time per epoch.
"""

from fast.perfmodel.allreduce import ALLREDUCE_ALGORITHMS, allreduce_cost
from fast.perfmodel.flops import (
    compute_communication_ratio,
    flops_per_sample,
    forward_flops_per_sample,
    trainable_parameter_count,
)
from fast.perfmodel.link import Link
from fast.perfmodel.ranking import rank_by_epoch_time
from fast.perfmodel.step import StepCost

__all__ = [
    "ALLREDUCE_ALGORITHMS",
    "Link",
    "StepCost",
    "allreduce_cost",
    "compute_communication_ratio",
    "flops_per_sample",
    "forward_flops_per_sample",
    "rank_by_epoch_time",
    "trainable_parameter_count",
]
