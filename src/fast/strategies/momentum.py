"""DGC's momentum correction (Lin et al. 2018 Sec. 3.2): SGD's momentum and weight decay applied by each worker to its
own gradient before compression, instead of by the optimizer after the sum."""

from __future__ import annotations

import torch
from torch import nn


class MomentumCorrection:
    """SGD's momentum and weight decay applied by each worker to its own gradient, before compression.

    A worker sends d + β u (Nesterov) or u, where d = g + λ w and u = β u + d is its own velocity, and the
    optimizer, its momentum and weight decay set to 0, steps with the mean of what arrived. Momentum is
    linear, so without compression this is the same SGD (torch's, first step included). With a lossy codec,
    error feedback then keeps what was not sent of the velocity, where the optimizer's momentum would
    otherwise amplify the codec's error (Lin et al. 2018; Zheng et al. 2019). Optimizers other than SGD
    keep their own state and get the compressed gradients.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.settings: dict[nn.Parameter, tuple[float, float, bool]] = {}  # momentum, weight decay, nesterov
        self.velocity: dict[nn.Parameter, torch.Tensor] = {}
        if not isinstance(optimizer, torch.optim.SGD):
            return
        for group in optimizer.param_groups:
            if group["dampening"] or group.get("maximize"):
                continue  # not the plain momentum this mirrors: left to the optimizer
            for p in group["params"]:
                self.settings[p] = (group["momentum"], group["weight_decay"], group["nesterov"])
            group.update(momentum=0.0, weight_decay=0.0, nesterov=False)

    def apply(self, params: list[nn.Parameter], gradients: list[torch.Tensor], bad: torch.Tensor | None = None) -> None:
        """Turn each parameter's gradient (in place) into what its worker sends. `bad`, a device flag: the gradients
        were not finite (the caller sends zeros instead), and the velocity stays as it was, decided on the device."""
        for p, gradient in zip(params, gradients, strict=True):
            if p not in self.settings:
                continue
            momentum, weight_decay, nesterov = self.settings[p]
            if weight_decay:
                gradient.add_(p.detach(), alpha=weight_decay)
            if not momentum:
                continue
            velocity = self.velocity.get(p)
            if velocity is None:
                velocity = gradient.clone() if bad is None else torch.where(bad, 0.0, gradient)
                self.velocity[p] = velocity
            elif bad is None:
                velocity.mul_(momentum).add_(gradient)
            else:
                velocity.copy_(torch.where(bad, velocity, velocity.mul(momentum).add_(gradient)))
            if nesterov:
                gradient.add_(velocity, alpha=momentum)
            else:
                gradient.copy_(velocity)
