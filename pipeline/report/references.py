"""Published top-1 accuracies that a run can be compared with, and the sentence that says so."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.config import Params

PROTOCOL_NAMES = {"knn": "kNN", "linear": "linear-probe"}


@dataclass(frozen=True)
class Reference:
    """A published top-1 accuracy to compare the run against.

    Attributes:
        protocol: ``"knn"`` or ``"linear"``: which of this run's results it is comparable to.
        top1: top-1 accuracy in percent.
        epochs: pretraining epochs behind the number.
        citation: where the number comes from.
    """

    protocol: str
    top1: float
    epochs: int
    citation: str


_CIFAR10_R18 = Reference(
    "knn",
    82.6,
    200,
    "MoCo CIFAR-10 demo (facebookresearch/moco colab notebook): ResNet-18, K=4096, m=0.99, "
    "T=0.1, kNN k=200 T=0.1",
)
_IMAGENET_R50_V2 = Reference(
    "linear",
    67.5,
    200,
    "MoCo v2 (Chen et al. 2020, facebookresearch/moco): ImageNet-1k, ResNet-50, linear probe",
)


def published_reference(params: Params) -> Reference | None:
    """The published number for this run's preset, or None when none is recorded.

    Recorded: CIFAR-10 + ResNet-18 (MoCo CIFAR demo, kNN 82.6 %, 200 epochs) and an ImageNet
    ImageFolder (``data.root`` containing "imagenet") + ResNet-50 + ``v2`` augmentation (MoCo v2,
    linear 67.5 %, 200 epochs). No MoCo number has been published for Fashion-MNIST.
    """
    d, backbone = params.data, params.model.backbone
    if d.source == "cifar10" and backbone == "resnet18":
        return _CIFAR10_R18
    if (
        d.source == "imagefolder"
        and backbone == "resnet50"
        and params.augment.preset == "v2"
        and "imagenet" in d.root.lower()
    ):
        return _IMAGENET_R50_V2
    return None


def reference_note(params: Params) -> str:
    """One sentence on what published number (if any) the results can be compared with."""
    ref = published_reference(params)
    if ref is None:
        if params.data.source == "fashion_mnist":
            return (
                "No MoCo result has been published for Fashion-MNIST: compare with the "
                "raw-pixel and random-encoder baselines instead."
            )
        return (
            f"No published reference number is recorded for {params.data.source} + "
            f"{params.model.backbone}: compare with the baselines instead."
        )
    note = (
        f"Published reference: {ref.top1:.1f} % {PROTOCOL_NAMES[ref.protocol]} top-1 after "
        f"{ref.epochs} pretraining epochs ({ref.citation})."
    )
    if params.pretrain.epochs != ref.epochs:
        note += f" This run pretrained for {params.pretrain.epochs} epochs."
    return note
