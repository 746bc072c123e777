"""The params the data can refute: the sources' facts, and the checks on them."""

import pytest

from pipeline.config import DataParams, from_dict
from pipeline.data.checks import (
    NATIVE_SIDE,
    PRETRAIN_IMAGES,
    SOURCE_MODES,
    check_preset_mode,
    check_queue_size,
    image_side,
    pretrain_images_bound,
)
from pipeline.errors import ParamsError


def test_source_modes__equal_the_source_classes_mode():
    # check_params matches augment.preset to these; the readers own the modes
    from pipeline.config import DataSource
    from pipeline.data.sources import CifarSource, FashionMnistSource, Stl10Source

    assert SOURCE_MODES == {DataSource.fashion_mnist: FashionMnistSource.mode,
                            DataSource.cifar10: CifarSource.mode,
                            DataSource.cifar100: CifarSource.mode,
                            DataSource.stl10: Stl10Source.mode}
    assert FashionMnistSource.mode == "L" and CifarSource.mode == Stl10Source.mode == "RGB"


def test_source_facts__cover_the_same_fixed_size_sources():
    assert set(NATIVE_SIDE) == set(PRETRAIN_IMAGES) == set(SOURCE_MODES)


@pytest.mark.parametrize(("data", "bound"), [
    ({}, 60000),                                                       # Fashion-MNIST train
    ({"max_pretrain_images": 100}, 100),                               # the cap is lower
    ({"source": "cifar10", "max_pretrain_images": 10**6}, 50000),      # the data is smaller
    ({"unlabelled_root": "photos"}, None),                             # the tree: unknown
    ({"unlabelled_root": "photos", "max_pretrain_images": 100}, 100),  # but capped
    ({"pretrain_shards": "s/{0..9}.tar", "max_pretrain_images": 100}, None),  # read whole
    ({"source": "none", "unlabelled_root": "p"}, None),
    ({"pretrain_labelled": False, "pretrain_shards": "s"}, None),
])
def test_pretrain_images_bound__what_the_params_fix(data, bound):
    assert pretrain_images_bound(DataParams(**data)) == bound


def test_check_queue_size__K_below_the_images_only():
    check_queue_size(99, 100, "here")
    with pytest.raises(ParamsError) as e:
        check_queue_size(100, 100, "here")
    assert e.value.key == "moco.K" and "< 100, the number of pretraining images (here)" in str(
        e.value)


def test_check_preset_mode__grey_refuses_colour_and_colour_warns_for_grey_preset():
    with pytest.raises(ParamsError) as e:
        check_preset_mode("v2", "L", "the tree")
    assert e.value.key == "augment.preset"
    assert check_preset_mode("v2_grey", "L", "the tree") is None
    assert check_preset_mode("v2", "RGB", "the tree") is None
    assert "v2_grey on 3-channel" in check_preset_mode("v2_grey", "RGB", "the tree")


def test_image_side__image_size_else_the_native_side():
    assert image_side(from_dict({})) == 28
    assert image_side(from_dict({"data": {"source": "stl10", "image_size": 64}})) == 64
    assert image_side(from_dict({"data": {"source": "imagefolder", "root": "x"}})) == 0
