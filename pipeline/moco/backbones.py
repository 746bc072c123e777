"""Backbone registry (ResNet-18/34/50 with width, input channels and a small-image stem) and heads.

The ResNets are torchvision's (same blocks, same attribute names, same initialisation, never
pretrained weights): with ``width=64, in_channels=3, small_stem=False`` a backbone's state-dict
keys and shapes equal ``torchvision.models.resnetXX()``'s, minus ``fc.*`` (the backbone's ``fc``
is ``nn.Identity`` during pretraining). An exported backbone therefore loads into a torchvision
ResNet with only the classifier (``fc.weight``, ``fc.bias``) missing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torchvision.models.resnet import BasicBlock, Bottleneck, ResNet

from pipeline.choices import Backbone, Head, Switch
from pipeline.errors import InputError
from pipeline.moco.geometry import uses_small_stem

_BACKBONES: dict[str, Callable[..., nn.Module]] = {}


def register_backbone(name: str) -> Callable[[Callable[..., nn.Module]], Callable[..., nn.Module]]:
    """Decorator registering a factory ``f(*, width, in_channels, small_stem, stem_stride)``.

    Args:
        name: a :class:`pipeline.config.Backbone` name (the schema of ``model.backbone``).

    Raises:
        ValueError: the name is not a ``Backbone`` or is already registered.
    """
    name = Backbone.parse(name, "register_backbone")

    def decorator(factory: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
        if name in _BACKBONES:
            raise InputError(f"backbone {name!r} is already registered")
        _BACKBONES[name] = factory
        return factory

    return decorator


def known_backbones() -> tuple[str, ...]:
    """The registered backbone names, sorted."""
    return tuple(sorted(_BACKBONES))


class WideResNet(ResNet):
    """torchvision's ResNet with a configurable first-stage width, input channels and stem.

    Same attributes as :class:`torchvision.models.ResNet` (``conv1, bn1, relu, maxpool,
    layer1..4, avgpool, fc``) and its ``forward``; stages have ``width, 2w, 4w, 8w`` planes
    (torchvision: w = 64). ``fc`` is ``nn.Identity``: the forward returns the ``(N, F)`` pooled
    features, ``F = num_features``.

    Args:
        block: ``BasicBlock`` (ResNet-18/34) or ``Bottleneck`` (ResNet-50).
        layers: blocks per stage, e.g. ``[2, 2, 2, 2]``.
        width: planes of the first stage (torchvision: 64).
        in_channels: input image channels (3 RGB, 1 grey).
        small_stem: 3×3 stride-1 ``conv1`` and no max-pool (MoCo CIFAR-10 demo, images ≤ 64 px)
            instead of the 7×7 stride-2 conv + 3×3 stride-2 max-pool.
        stem_stride: stride of the small stem's 3×3 ``conv1`` (1 = the CIFAR demo; 2 halves the
            side before ``layer1``: 28 px → 14 px, ~4× fewer FLOPs per image at equal width,
            which pays for 2× the width). Must be 1 with the ImageNet stem.

    Raises:
        ValueError: ``width < 1``, ``in_channels < 1``, ``stem_stride`` not 1 or 2, or
            ``stem_stride`` 2 without the small stem.
    """

    def __init__(
        self,
        block: type[BasicBlock | Bottleneck],
        layers: list[int],
        *,
        width: int = 64,
        in_channels: int = 3,
        small_stem: bool = False,
        stem_stride: int = 1,
    ) -> None:
        if stem_stride not in (1, 2):
            raise InputError(f"model.stem_stride must be 1 or 2, got {stem_stride}")
        if stem_stride != 1 and not small_stem:
            raise InputError("model.stem_stride 2 needs the small 3x3 stem (model.small_stem true, "
                             "or auto below 64 px); the ImageNet stem already has stride 4")
        if width < 1:
            raise InputError(f"model.width must be >= 1, got {width}")
        if in_channels < 1:
            raise InputError(f"in_channels must be >= 1, got {in_channels}")
        nn.Module.__init__(self)  # ResNet.__init__ hard-codes 64 channels and 3 inputs
        # attributes used by ResNet._make_layer
        self._norm_layer = nn.BatchNorm2d
        self.inplanes = width
        self.dilation = 1
        self.groups = 1
        self.base_width = 64  # Bottleneck inner width = planes * base_width / 64 = planes
        if small_stem:  # MoCo CIFAR-10 demo: 3x3 stride-1 conv, no max-pool
            self.conv1 = nn.Conv2d(in_channels, width, 3, stride=stem_stride, padding=1,
                                   bias=False)
        else:  # ImageNet stem: 7x7 stride-2 conv + 3x3 stride-2 max-pool
            self.conv1 = nn.Conv2d(in_channels, width, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool: nn.Module = (
            nn.Identity() if small_stem else nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        )
        self.layer1 = self._make_layer(block, width, layers[0])
        self.layer2 = self._make_layer(block, 2 * width, layers[1], stride=2)
        self.layer3 = self._make_layer(block, 4 * width, layers[2], stride=2)
        self.layer4 = self._make_layer(block, 8 * width, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc: nn.Module = nn.Identity()
        self.num_features = 8 * width * block.expansion
        for m in self.modules():  # torchvision's initialisation
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)


@register_backbone("resnet18")
def resnet18(*, width: int = 64, in_channels: int = 3, small_stem: bool = False,
             stem_stride: int = 1) -> WideResNet:
    """ResNet-18 (BasicBlock, [2, 2, 2, 2]); ``num_features = 8 * width``."""
    return WideResNet(
        BasicBlock, [2, 2, 2, 2], width=width, in_channels=in_channels, small_stem=small_stem,
        stem_stride=stem_stride,
    )


@register_backbone("resnet34")
def resnet34(*, width: int = 64, in_channels: int = 3, small_stem: bool = False,
             stem_stride: int = 1) -> WideResNet:
    """ResNet-34 (BasicBlock, [3, 4, 6, 3]); ``num_features = 8 * width``."""
    return WideResNet(
        BasicBlock, [3, 4, 6, 3], width=width, in_channels=in_channels, small_stem=small_stem,
        stem_stride=stem_stride,
    )


@register_backbone("resnet50")
def resnet50(*, width: int = 64, in_channels: int = 3, small_stem: bool = False,
             stem_stride: int = 1) -> WideResNet:
    """ResNet-50 (Bottleneck, [3, 4, 6, 3]); ``num_features = 32 * width``."""
    return WideResNet(
        Bottleneck, [3, 4, 6, 3], width=width, in_channels=in_channels, small_stem=small_stem,
        stem_stride=stem_stride,
    )


def build_backbone(
    name: str, *, width: int = 64, in_channels: int = 3, small_stem: bool = False,
    stem_stride: int = 1,
) -> nn.Module:
    """Build a registered backbone, randomly initialised.

    Args:
        name: ``resnet18``, ``resnet34``, ``resnet50`` (``model.backbone``).
        width: first-stage channels (``model.width``; torchvision 64).
        in_channels: image channels (1 for Fashion-MNIST, 3 otherwise).
        small_stem: 3×3 stride-1 stem without max-pool (see :func:`resolve_small_stem`).
        stem_stride: stride of that small stem's conv (``model.stem_stride``; 1 or 2).

    Returns:
        The backbone: ``(N, in_channels, H, W)`` → ``(N, num_features)``; ``fc`` is
        ``nn.Identity`` and the attribute ``num_features`` gives the feature width.

    Raises:
        ValueError: unknown name (the message lists the known ones) or invalid width/channels.
    """
    if name not in _BACKBONES:
        raise InputError(
            f"unknown backbone {name!r} (model.backbone); known backbones: "
            f"{', '.join(known_backbones())}"
        )
    return _BACKBONES[name](width=width, in_channels=in_channels, small_stem=small_stem,
                            stem_stride=stem_stride)


def resolve_stem_stride(stem_stride: int, small_stem: bool) -> int:
    """The stride the small stem's conv gets from ``model.stem_stride``.

    ``model.stem_stride`` only applies to the small 3×3 stem; the ImageNet stem keeps its own
    stride-2 7×7 conv and max-pool, so with it the setting resolves to 1 (the default stride 2,
    chosen for 28 px images, then does not block ``small_stem: false`` or large images).

    Args:
        stem_stride: ``model.stem_stride`` (1 or 2).
        small_stem: whether the backbone uses the small stem (see :func:`resolve_small_stem`).

    Returns:
        ``stem_stride`` with the small stem, else 1.
    """
    return stem_stride if small_stem else 1


def resolve_small_stem(setting: Switch | str | bool, image_size: int) -> bool:
    """Resolve ``model.small_stem`` (``auto|true|false``) for images of ``image_size`` pixels.

    ``auto`` means the small stem below 64 px (CIFAR 32 px, Fashion-MNIST 28 px: the 7×7/2 conv
    plus max-pool would shrink them 4× before the first stage), the ImageNet stem otherwise
    (:func:`pipeline.moco.geometry.uses_small_stem`).

    Raises:
        ValueError: an unknown setting or ``image_size < 1``.
    """
    if Switch.parse(setting, "model.small_stem") is Switch.auto and image_size < 1:
        raise InputError(f"resolve_small_stem: image_size must be >= 1, got {image_size}")
    return uses_small_stem(setting, image_size)


def build_head(kind: str, in_dim: int, hidden: int, dim: int) -> nn.Sequential:
    """Projection head on top of the backbone features.

    Args:
        kind: ``linear`` (MoCo v1: one Linear) or ``mlp`` (MoCo v2: Linear-ReLU-Linear).
        in_dim: backbone feature width ``F`` (``backbone.num_features``).
        hidden: MLP hidden width (MoCo v2 uses ``F``: 2048 for ResNet-50); ignored for linear.
        dim: output dimension ``D`` of queries and keys (128 in MoCo v1/v2).

    Returns:
        ``(N, F)`` → ``(N, D)`` module (a Sequential, so both kinds have indexed keys).

    Raises:
        ValueError: unknown kind or a non-positive width.
    """
    kind = Head.parse(kind, "model.head")
    if min(in_dim, dim) < 1 or (kind == Head.mlp and hidden < 1):
        raise InputError(
            f"build_head: widths must be >= 1, got in_dim={in_dim}, hidden={hidden}, dim={dim}"
        )
    if kind == Head.linear:
        return nn.Sequential(nn.Linear(in_dim, dim))
    return nn.Sequential(nn.Linear(in_dim, hidden), nn.ReLU(inplace=True), nn.Linear(hidden, dim))


def export_state_dict(backbone: nn.Module) -> dict[str, torch.Tensor]:
    """The backbone's weights as a plain torchvision-style ResNet ``state_dict`` on the CPU.

    SplitBatchNorm2d and SyncBatchNorm layers have the same keys as ``BatchNorm2d``, and every
    ``fc.*`` key is dropped: loading the result into ``build_backbone(...)`` (or a torchvision
    ResNet of the same shape) whose ``fc`` is an ``nn.Linear`` with ``strict=False`` leaves
    exactly ``fc.weight`` and ``fc.bias`` missing and nothing unexpected.

    Args:
        backbone: a backbone from :func:`build_backbone` (possibly with converted BN layers).

    Returns:
        Detached CPU copies of the parameters and buffers, ``fc.*`` excluded.
    """
    return {
        key: value.detach().to("cpu", copy=True)
        for key, value in backbone.state_dict().items()
        if not key.startswith("fc.")
    }
