from pipeline.config import from_dict
from pipeline.report.references import published_reference, reference_note


def test_published_reference__presets():
    cifar = from_dict(
        {
            "data": {"source": "cifar10"},
            "model": {"backbone": "resnet18"},
            "pretrain": {"epochs": 200},
        }
    )
    ref = published_reference(cifar)
    assert (ref.protocol, ref.top1, ref.epochs) == ("knn", 82.6, 200)
    assert "82.6 %" in reference_note(cifar)
    imagenet = from_dict(
        {
            "data": {"source": "imagefolder", "root": "/datasets/ImageNet"},
            "model": {"backbone": "resnet50"},
            "augment": {"preset": "v2"},
        }
    )
    assert published_reference(imagenet).top1 == 67.5
    fashion = from_dict({})
    assert published_reference(fashion) is None
    assert "No MoCo result has been published for Fashion-MNIST" in reference_note(fashion)


def test_reference_note__other_epochs_said():
    cifar = from_dict({"data": {"source": "cifar10"}, "pretrain": {"epochs": 50}})
    assert reference_note(cifar).endswith("This run pretrained for 50 epochs.")
