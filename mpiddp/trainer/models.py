"""Model construction by name: the small digits CNN or any torchvision classification model. No distributed code."""

from __future__ import annotations

import difflib

import torch
from torch import nn

from mpiddp.errors import UserError

BUILTIN = ("digits_cnn",)


class MaxPoolTo4(nn.Module):
    """Max-pool any input to 4x4. Plain max pooling when the size is a multiple of 4 (8x8 digits, 28x28 MNIST,
    32x32 CIFAR): its CUDA backward is deterministic, adaptive pooling's is not (--deterministic would fail)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        height, width = x.shape[-2:]
        if height % 4 == 0 and width % 4 == 0:
            return nn.functional.max_pool2d(x, (height // 4, width // 4))
        return nn.functional.adaptive_max_pool2d(x, 4)


class DigitsCNN(nn.Module):
    """A small CNN for small grey or colour images: two conv blocks and a two-layer head (about 140k parameters)."""

    def __init__(self, num_classes: int = 10, in_channels: int = 1) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 32, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(32, 64, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            MaxPoolTo4(),  # 8x8 digits -> 4x4; larger inputs pool to the same head
        )
        self.head = nn.Sequential(
            nn.Flatten(),
            nn.Linear(64 * 4 * 4, 128),
            nn.ReLU(inplace=True),
            nn.Linear(128, num_classes),
        )

    def forward(self, x):  # type: ignore[no-untyped-def]
        return self.head(self.features(x))


def available_models() -> list[str]:
    """Every name --arch accepts."""
    import torchvision

    return sorted([*BUILTIN, *torchvision.models.list_models(module=torchvision.models)])


def check_arch(name: str) -> None:
    """Raise a UserError naming close matches when `name` is not a model mpiddp can build."""
    if name in BUILTIN:
        return  # without importing torchvision: about 2.5 s per rank at start-up, for nothing
    names = available_models()
    if name in names:
        return
    close = difflib.get_close_matches(name.lower(), names, n=5, cutoff=0.5)
    hint = f"did you mean {', '.join(close)}?" if close else f"choose one of {', '.join(names[:12])}, ..."
    raise UserError(f"unknown --arch {name!r}: {hint} (python -m mpiddp.trainer.models lists all {len(names)})")


# Models whose training-mode forward returns a namedtuple with auxiliary heads: built without them.
AUX_LOGITS = ("googlenet", "inception_v3")


def build_model(name: str = "digits_cnn", num_classes: int = 10, in_channels: int = 1,
                image_size: int | None = None) -> nn.Module:
    """A freshly initialised model; torchvision models expect 3 input channels (grey data is repeated).
    `image_size` matters to vision transformers, whose position embeddings are made for one size."""
    if name == "digits_cnn":
        return DigitsCNN(num_classes, in_channels)
    check_arch(name)
    import torchvision

    options: dict[str, object] = {}
    if name in AUX_LOGITS:
        options.update(aux_logits=False, init_weights=True)
    if name.startswith("vit_") and image_size is not None:
        patch = int(name.rsplit("_", 1)[1])
        if image_size % patch:
            raise UserError(f"--arch {name} cuts images into {patch}x{patch} patches: use an --image-size that is "
                            f"a multiple of {patch} (this data is {image_size}x{image_size})")
        options["image_size"] = image_size
    return torchvision.models.get_model(name, weights=None, num_classes=num_classes, **options)


def input_channels(name: str, data_channels: int) -> int:
    """Channels the data must have for this model: the CNN takes what the data has; torchvision wants RGB."""
    return data_channels if name in BUILTIN else 3


if __name__ == "__main__":
    print("\n".join(available_models()))
