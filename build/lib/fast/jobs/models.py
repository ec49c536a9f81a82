"""The reference models FAST trains: an MLP, LeNet-5, the pure-LSTM of Wongpanich et al. 2020 and a small ResNet.

Every model takes images of shape (B, C, H, W) and returns class logits (B, classes); each works on
inputs as small as the 8x8 `digits` and as large as 28x28 MNIST-like images. Weights come from torch's
global random generator, so `torch.manual_seed(s)` before `build_model` makes a model reproducible.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from fast.errors import ConfigError

MODELS: tuple[str, ...] = ("mlp", "lenet", "lstm", "resnet8")


def build_model(name: str, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """A freshly initialised model `name` for samples of shape (C, H, W) and `num_classes` classes."""
    if len(input_shape) != 3 or min(input_shape) < 1:
        raise ConfigError(f"input_shape must be (C, H, W) with positive sizes, got {tuple(input_shape)}")
    if num_classes < 2:
        raise ConfigError(f"num_classes must be at least 2, got {num_classes}")
    builders: dict[str, Callable[[tuple[int, int, int], int], nn.Module]] = {
        "mlp": MLP,
        "lenet": LeNet5,
        "lstm": PixelRowLSTM,
        "resnet8": ResNet8,
    }
    if name not in builders:
        raise ConfigError(f"unknown model {name!r}: choose one of {', '.join(MODELS)}")
    return builders[name](tuple(input_shape), num_classes)


class MLP(nn.Module):
    """Flattened pixels through two ReLU hidden layers (256 and 128 wide)."""

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int, hidden: tuple[int, int] = (256, 128)):
        super().__init__()
        channels, height, width = input_shape
        self.layers = nn.Sequential(
            nn.Flatten(),
            nn.Linear(channels * height * width, hidden[0]),
            nn.ReLU(),
            nn.Linear(hidden[0], hidden[1]),
            nn.ReLU(),
            nn.Linear(hidden[1], num_classes),
        )

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.layers(images)


class LeNet5(nn.Module):
    """LeNet-5 (LeCun et al. 1998), the MNIST model of Wongpanich et al. 2020, with ReLU and max pooling.

    conv(6, 5x5) -> pool -> conv(16, 5x5) -> pool -> fc120 -> fc84 -> classes. The first convolution is
    padded by 2, which turns 28x28 images into the 32x32 frame LeNet-5 was designed for; the second is
    padded only when the input is too small to survive it unpadded (8x8 digits), and the flattened size
    comes from a dry run.
    """

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int):
        super().__init__()
        channels, height, width = input_shape
        if min(height, width) < 4:
            raise ConfigError(f"lenet needs images of at least 4x4 pixels, got {height}x{width}")
        pooled = min(height, width) // 2
        second_padding = 0 if pooled - 4 >= 2 else 2
        self.features = nn.Sequential(
            nn.Conv2d(channels, 6, kernel_size=5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(6, 16, kernel_size=5, padding=second_padding),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
        )
        with torch.no_grad():
            flat = self.features(torch.zeros(1, *input_shape)).shape[1]
        self.classifier = nn.Sequential(
            nn.Linear(flat, 120),
            nn.ReLU(),
            nn.Linear(120, 84),
            nn.ReLU(),
            nn.Linear(84, num_classes),
        )

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(images))


class PixelRowLSTM(nn.Module):
    """The pure-LSTM MNIST model of Wongpanich et al. 2020 (Sec. 4.5.3): the image read row by row.

    Each of the H rows (C*W values) is one time step; a linear 128-wide input transform feeds an LSTM
    with 128 hidden units, and a linear classifier reads the last time step's output.
    """

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int, width: int = 128):
        super().__init__()
        channels, _, image_width = input_shape
        self.input_transform = nn.Linear(channels * image_width, width)
        self.lstm = nn.LSTM(width, width, batch_first=True)
        self.classifier = nn.Linear(width, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        batch, channels, height, width = images.shape
        rows = images.permute(0, 2, 1, 3).reshape(batch, height, channels * width)
        outputs, _ = self.lstm(self.input_transform(rows))
        return self.classifier(outputs[:, -1])


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with batch norm and a shortcut (a 1x1 projection where the shape changes)."""

    def __init__(self, in_channels: int, out_channels: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


class ResNet8(nn.Module):
    """A small residual network: a 3x3 stem, three one-block stages (16, 32, 64 channels), pooling, fc.

    Eight weighted layers on the main path (stem, six block convolutions, fc); stages two and three
    halve the resolution, so 8x8 inputs end at 2x2 and 28x28 at 7x7 before global average pooling.
    """

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int, widths: tuple[int, ...] = (16, 32, 64)):
        super().__init__()
        channels = input_shape[0]
        self.stem = nn.Sequential(
            nn.Conv2d(channels, widths[0], 3, padding=1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU()
        )
        stages = []
        previous = widths[0]
        for index, width in enumerate(widths):
            stages.append(BasicBlock(previous, width, stride=1 if index == 0 else 2))
            previous = width
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(previous, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        features = self.pool(self.stages(self.stem(images)))
        return self.fc(features.flatten(1))
