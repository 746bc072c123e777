"""Augmentation presets against the published tables; seeded two-crop reproducibility."""

import random

import numpy as np
import pytest
import torch
from PIL import Image, ImageFilter
from reference_views import (
    RandomGaussianBlur,
    TwoCropTransform,
    build_pretrain_transform,
    sample_seed,
)
from torchvision import transforms as T

from pipeline.data.views import build_eval_transform

RGB = ((0.5, 0.4, 0.3), (0.2, 0.25, 0.3))
GREY = ((0.286,), (0.353,))  # Fashion-MNIST statistics
JITTER = (0.6, 1.4)  # ColorJitter(0.4) -> factor in [1 - 0.4, 1 + 0.4]


def _rgb(size=40, seed=0):
    arr = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    return Image.fromarray(arr, "RGB")


def _grey(size=28, seed=0):
    arr = np.random.default_rng(seed).integers(0, 256, (size, size), dtype=np.uint8)
    return Image.fromarray(arr, "L")


def _check_crop(t, size, min_scale):
    assert type(t) is T.RandomResizedCrop
    assert t.size == (size, size) and t.scale == (min_scale, 1.0)
    assert t.ratio == pytest.approx((3 / 4, 4 / 3))


def _check_tail(ops, mean, std):
    flip, to_tensor, norm = ops
    assert type(flip) is T.RandomHorizontalFlip and flip.p == 0.5
    assert type(to_tensor) is T.ToTensor
    assert type(norm) is T.Normalize and tuple(norm.mean) == mean and tuple(norm.std) == std


def _check_jitter(j, b, c, s, h):
    assert type(j) is T.ColorJitter
    assert (j.brightness, j.contrast, j.saturation, j.hue) == (b, c, s, h)


def test_build_pretrain_transform__v1_table():
    ops = build_pretrain_transform("v1", 32, *RGB).transforms
    assert len(ops) == 6
    _check_crop(ops[0], 32, 0.2)
    assert type(ops[1]) is T.RandomGrayscale and ops[1].p == 0.2
    _check_jitter(ops[2], JITTER, JITTER, JITTER, (-0.4, 0.4))  # always applied
    _check_tail(ops[3:], *RGB)


@pytest.mark.parametrize("preset", ["v2", "v2_small"])
def test_build_pretrain_transform__v2_table(preset):
    ops = build_pretrain_transform(preset, 224, *RGB, crop_min_scale=0.3).transforms
    _check_crop(ops[0], 224, 0.3)
    assert type(ops[1]) is T.RandomApply and ops[1].p == 0.8 and len(ops[1].transforms) == 1
    _check_jitter(ops[1].transforms[0], JITTER, JITTER, JITTER, (-0.1, 0.1))
    assert type(ops[2]) is T.RandomGrayscale and ops[2].p == 0.2
    if preset == "v2":
        assert type(ops[3]) is T.RandomApply and ops[3].p == 0.5
        (blur,) = ops[3].transforms
        assert type(blur) is RandomGaussianBlur and blur.sigma == (0.1, 2.0)
        rest = ops[4:]
    else:  # no blur below 64 px
        rest = ops[3:]
    _check_tail(rest, *RGB)


def test_build_pretrain_transform__v2_grey_table():
    ops = build_pretrain_transform("v2_grey", 28, *GREY).transforms
    assert len(ops) == 5
    _check_crop(ops[0], 28, 0.2)
    assert type(ops[1]) is T.RandomApply and ops[1].p == 0.8
    _check_jitter(ops[1].transforms[0], JITTER, JITTER, None, None)
    _check_tail(ops[2:], *GREY)


def test_build_pretrain_transform__output_shapes_and_errors():
    assert build_pretrain_transform("v2", 32, *RGB)(_rgb()).shape == (3, 32, 32)
    assert build_pretrain_transform("v2_grey", 24, *GREY)(_grey()).shape == (1, 24, 24)
    with pytest.raises(ValueError, match="augment.preset"):
        build_pretrain_transform("v3", 32, *RGB)
    with pytest.raises(ValueError, match="crop_min_scale"):
        build_pretrain_transform("v2", 32, *RGB, crop_min_scale=0.0)


def test_build_eval_transform__imagenet_resize_and_small_identity():
    ops = build_eval_transform(224, *RGB).transforms
    assert type(ops[0]) is T.Resize and ops[0].size == 256  # 224 / 0.875
    assert type(ops[1]) is T.CenterCrop and ops[1].size == (224, 224)
    assert build_eval_transform(224, *RGB)(_rgb(300)).shape == (3, 224, 224)
    img = _grey(28)
    expected = (torch.from_numpy(np.array(img)).float() / 255 - 0.286) / 0.353
    torch.testing.assert_close(build_eval_transform(28, *GREY)(img), expected[None])


def test_random_gaussian_blur__sigma_from_torch_rng_and_blurs():
    blur = RandomGaussianBlur((1.0, 1.0))
    img = Image.new("L", (9, 9), 0)
    img.putpixel((4, 4), 255)
    out = blur(img)
    assert out.tobytes() == img.filter(ImageFilter.GaussianBlur(radius=1.0)).tobytes()
    assert 0 < out.getpixel((4, 4)) < 255 and out.getpixel((4, 5)) > 0  # the dot spreads
    wide = RandomGaussianBlur((0.1, 2.0))
    torch.manual_seed(0)
    a = wide(img).tobytes()
    torch.manual_seed(0)
    assert wide(img).tobytes() == a  # sigma drawn from the torch RNG
    with pytest.raises(ValueError, match="sigma"):
        RandomGaussianBlur((2.0, 1.0))


def test_two_crop_transform__same_seed_same_pair_different_key_different():
    two = TwoCropTransform(build_pretrain_transform("v2", 32, *RGB))
    img = _rgb()
    q1, k1 = two(img, sample_seed(0, 1, "a"))
    random.seed(123)  # Python's RNG is not used: perturbing it changes nothing
    torch.rand(5)  # nor is the global torch RNG
    q2, k2 = two(img, sample_seed(0, 1, "a"))
    assert torch.equal(q1, q2) and torch.equal(k1, k2)
    assert not torch.equal(q1, k1)  # the two views differ
    q3, _ = two(img, sample_seed(0, 1, "b"))
    q4, _ = two(img, sample_seed(0, 2, "a"))
    assert not torch.equal(q1, q3) and not torch.equal(q1, q4)


def test_two_crop_transform__global_rng_states_untouched():
    two = TwoCropTransform(build_pretrain_transform("v2_grey", 28, *GREY))
    torch_state, py_state = torch.get_rng_state(), random.getstate()
    q, k = two(_grey(), 42)
    assert q.shape == k.shape == (1, 28, 28)
    assert torch.equal(torch.get_rng_state(), torch_state) and random.getstate() == py_state
