"""Model construction by name. No distributed code here."""

from __future__ import annotations

from torch import nn


class DigitsCNN(nn.Module):
    """A small CNN for 8x8 grey images: two conv blocks and a two-layer head (about 140k parameters)."""

    def __init__(self, num_classes: int = 10, in_channels: int = 1) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 32, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(32, 64, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),  # 8x8 -> 4x4
        )
        self.head = nn.Sequential(
            nn.Flatten(),
            nn.Linear(64 * 4 * 4, 128),
            nn.ReLU(inplace=True),
            nn.Linear(128, num_classes),
        )

    def forward(self, x):  # type: ignore[no-untyped-def]
        return self.head(self.features(x))


def build_model(name: str = "digits_cnn", num_classes: int = 10) -> nn.Module:
    if name == "digits_cnn":
        return DigitsCNN(num_classes)
    raise ValueError(f"unknown model {name!r}")
