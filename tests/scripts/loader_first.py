"""Calls the job before fast.init: a usage error, one line."""

import torch

import fast

loader = fast.loader(torch.utils.data.TensorDataset(torch.zeros(4, 2)), batch_size=2)
