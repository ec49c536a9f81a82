"""FLOPs of a model per sample, counted by torch's FlopCounterMode, and its computation/communication ratio.

FlopCounterMode counts matrix products and convolutions (2 FLOPs per multiply-add), not element-wise
work such as activations, normalisation or bias additions. On CPU, recurrent layers run as one fused
oneDNN kernel it cannot see, so oneDNN is switched off while counting: they then run as the matrix
products they are made of.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from fast.errors import ConfigError

# Backward computes a gradient for the input and one for the weights, each about as costly as forward.
TRAINING_FLOPS_PER_FORWARD_FLOP = 3


def forward_flops_per_sample(
    model: nn.Module, input_shape: tuple[int, ...], input_dtype: torch.dtype = torch.float32
) -> float:
    """FLOPs of one forward pass on a batch of one sample of shape `input_shape` (batch dimension excluded).

    The model runs in eval mode (batch norm on one sample), without gradients, and is left as it was.
    """
    parameter = next(model.parameters(), None)
    device = parameter.device if parameter is not None else torch.device("cpu")
    return forward_flops(model, (torch.zeros((1, *input_shape), dtype=input_dtype, device=device),), {})


def forward_flops(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> float:
    """FLOPs of one forward pass `model(*args, **kwargs)`, in eval mode and without gradients (the model is left as
    it was)."""
    was_training = model.training
    mkldnn_was_enabled = torch.backends.mkldnn.enabled
    counter = FlopCounterMode(display=False)
    try:
        model.eval()
        torch.backends.mkldnn.enabled = False
        with torch.no_grad(), counter:
            model(*args, **kwargs)
    finally:
        torch.backends.mkldnn.enabled = mkldnn_was_enabled
        model.train(was_training)
    return float(counter.get_total_flops())


def flops_per_sample(model: nn.Module, input_shape: tuple[int, ...], input_dtype: torch.dtype = torch.float32) -> float:
    """Training FLOPs of one sample: forward + backward ≈ 3 × forward."""
    return TRAINING_FLOPS_PER_FORWARD_FLOP * forward_flops_per_sample(model, input_shape, input_dtype)


def trainable_parameter_count(model: nn.Module) -> int:
    """The number of values a gradient exchange carries: the parameters that require gradients."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def compute_communication_ratio(
    model: nn.Module, input_shape: tuple[int, ...], input_dtype: torch.dtype = torch.float32
) -> float:
    """The CC ratio of Wongpanich et al. 2020 Sec. 4.6: operations to process one sample / number of parameters.

    The paper counts the operations of one forward pass: ResNet-50's 7.7e9 (its 3.9e9 multiply-adds,
    twice) over 25e6 parameters gives its 308. High ratios favour sync solvers, low ones async.
    """
    parameters = trainable_parameter_count(model)
    if parameters == 0:
        raise ConfigError("the model has no trainable parameters, so there is nothing to communicate")
    return forward_flops_per_sample(model, input_shape, input_dtype) / parameters
