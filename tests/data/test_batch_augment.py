"""Batched two-crop views (kornia) against the torchvision reference, in distribution."""

import numpy as np
import pytest
import torch
from torchvision import transforms as T

from pipeline.data.views import BatchTwoCrop, build_batch_view

RGB = ((0.5, 0.4, 0.3), (0.2, 0.25, 0.3))
GREY = ((0.286,), (0.353,))
N = 4000


def _params(preset: str, size: int = 32, channels: int = 3, min_scale: float = 0.2):
    view = build_batch_view(preset, size, *(RGB if channels == 3 else GREY),
                            crop_min_scale=min_scale)
    torch.manual_seed(0)
    view(torch.rand(N, channels, size, size))
    return {type(m).__name__: m._params for m in view}


def _crop_area_aspect(src: torch.Tensor, size: int) -> tuple[np.ndarray, np.ndarray]:
    w = (src[:, 1, 0] - src[:, 0, 0] + 1).numpy()
    h = (src[:, 2, 1] - src[:, 1, 1] + 1).numpy()
    return w * h / size**2, w / h


def _torchvision_area_aspect(size: int, min_scale: float) -> tuple[np.ndarray, np.ndarray]:
    torch.manual_seed(1)
    img = torch.zeros(1, size, size)
    boxes = [T.RandomResizedCrop.get_params(img, (min_scale, 1.0), (3 / 4, 4 / 3))
             for _ in range(N)]
    h = np.array([b[2] for b in boxes], dtype=float)
    w = np.array([b[3] for b in boxes], dtype=float)
    return w * h / size**2, w / h


@pytest.mark.parametrize("min_scale", [0.2, 0.08])
def test_random_resized_crop__area_and_aspect_match_torchvision(min_scale):
    area, aspect = _crop_area_aspect(_params("v2_small", min_scale=min_scale)
                                     ["RandomResizedCrop"]["src"], 32)
    ref_area, ref_aspect = _torchvision_area_aspect(32, min_scale)
    assert area.min() >= min_scale * 0.8 and area.max() <= 1.0
    # histograms over the same bins: total variation distance below 0.06 (sampling noise at
    # N = 4,000 is ~0.03); means within 0.02
    bins = np.linspace(min_scale * 0.8, 1.0, 11)
    tv = 0.5 * np.abs(np.histogram(area, bins)[0] - np.histogram(ref_area, bins)[0]).sum() / N
    assert tv < 0.06 and abs(area.mean() - ref_area.mean()) < 0.02
    abins = np.linspace(0.6, 1.5, 10)
    tv_a = 0.5 * np.abs(np.histogram(aspect, abins)[0] - np.histogram(ref_aspect, abins)[0]).sum()
    assert tv_a / N < 0.06


def test_presets__probabilities_and_jitter_ranges():
    p = _params("v2")
    assert p["RandomHorizontalFlip"]["batch_prob"].float().mean() == pytest.approx(0.5, abs=0.03)
    assert p["ColorJitter"]["batch_prob"].float().mean() == pytest.approx(0.8, abs=0.03)
    assert p["RandomGrayscale"]["batch_prob"].float().mean() == pytest.approx(0.2, abs=0.03)
    assert p["RandomGaussianBlur"]["batch_prob"].float().mean() == pytest.approx(0.5, abs=0.03)
    # sigma ~ U[0.1, 2] (MoCo v2): N = 4,000 draws reach within 0.02 of both ends (a gap of
    # 0.02 is missed with probability (1 - 0.02 / 1.9) ** 4000 ~ e^-42); mean 1.05 +- 0.009
    sigma = p["RandomGaussianBlur"]["sigma"]
    assert 0.1 <= sigma.min() < 0.12 and 1.98 < sigma.max() <= 2.0
    assert sigma.mean() == pytest.approx(1.05, abs=0.04)
    j = p["ColorJitter"]
    for name in ("brightness_factor", "contrast_factor", "saturation_factor"):
        f = j[name]
        assert 0.6 <= f.min() < 0.62 and 1.38 < f.max() <= 1.4, name  # U[1 - 0.4, 1 + 0.4]
    hue = j["hue_factor"]  # U[-0.1, 0.1] (v2), U[-0.4, 0.4] (v1): both ends reached, as above
    assert -0.1 <= hue.min() < -0.098 and 0.098 < hue.max() <= 0.1
    v1 = _params("v1")
    assert v1["ColorJitter"]["batch_prob"].all()  # v1: jitter always
    hue = v1["ColorJitter"]["hue_factor"]
    assert -0.4 <= hue.min() < -0.39 and 0.39 < hue.max() <= 0.4
    grey = _params("v2_grey", size=28, channels=1)
    assert set(grey) == {"RandomResizedCrop", "ColorJitter", "RandomHorizontalFlip", "Normalize"}
    assert (grey["ColorJitter"]["saturation_factor"] == 1).all()  # only brightness, contrast


def test_views__pure_function_of_seed_and_global_rng_untouched():
    two = BatchTwoCrop(build_batch_view("v2_grey", 28, *GREY))
    x = torch.randint(0, 256, (16, 1, 28, 28), dtype=torch.uint8)
    state = torch.get_rng_state()
    q1, k1 = two(x, 123)
    assert torch.equal(torch.get_rng_state(), state)
    q2, k2 = two(x, 123)
    q3, _ = two(x, 124)
    assert torch.equal(q1, q2) and torch.equal(k1, k2) and not torch.equal(q1, q3)
    assert not torch.equal(q1, k1)  # query and key are different draws
    assert q1.shape == (16, 1, 28, 28) and q1.dtype == torch.float32


def test_views__normalised_identity_crop_by_hand():
    # scale 1 with a square image: the crop keeps the whole image; a constant image of value v
    # (uint8) becomes (v/255 - mean)/std wherever jitter did not apply and flip does nothing
    view = build_batch_view("v2_grey", 8, (0.5,), (0.25,), crop_min_scale=1.0)
    view[1].p = 0.0  # no jitter
    x = torch.full((4, 1, 8, 8), 204, dtype=torch.uint8)
    q, _ = BatchTwoCrop(view)(x, 0)
    assert torch.allclose(q, torch.full_like(q, (204 / 255 - 0.5) / 0.25), atol=1e-5)


def test_build_batch_view__bad_input():
    with pytest.raises(ValueError, match="augment.preset"):
        build_batch_view("v3", 32, *RGB)
    with pytest.raises(ValueError, match="crop_min_scale"):
        build_batch_view("v2", 32, *RGB, crop_min_scale=0)
    with pytest.raises(ValueError, match="uint8"):
        BatchTwoCrop(build_batch_view("v2", 8, *RGB))(torch.zeros(2, 3, 8, 8), 0)


def test_batch_two_crop__small_crops_after_q_and_k_which_stay_unchanged():
    x = torch.randint(0, 256, (6, 1, 28, 28), dtype=torch.uint8)
    grey = ((0.3,), (0.3,))
    full = build_batch_view("v2_grey", 28, *grey, 0.5)
    small = build_batch_view("v2_grey", 12, *grey, 0.05, crop_max_scale=0.4)
    q0, k0 = BatchTwoCrop(full)(x, 5)
    q, k, s = BatchTwoCrop(full, small_view=small, small_crops=3).draw_all(x, 5)
    assert torch.equal(q, q0) and torch.equal(k, k0)  # drawn first, under the same seed
    assert len(s) == 3 and all(v.shape == (6, 1, 12, 12) for v in s)
    assert not torch.equal(s[0], s[1])
    _, _, again = BatchTwoCrop(full, small_view=small, small_crops=3).draw_all(x, 5)
    assert all(torch.equal(a, b) for a, b in zip(s, again))
    with pytest.raises(ValueError, match="crop scale range"):
        build_batch_view("v2_grey", 12, *grey, 0.5, crop_max_scale=0.4)


def _ref_ops(preset, size, mean, std, scale):
    """The per-image torchvision recipe (tests/data/reference_views.py) as canonical tuples."""
    from reference_views import RandomGaussianBlur, build_pretrain_transform

    def jitter(j, p):
        rng = [getattr(j, a) for a in ("brightness", "contrast", "saturation", "hue")]
        return ("jitter", p, *[tuple(round(x, 6) for x in r) if r else None for r in rng])

    out = []
    for op in build_pretrain_transform(preset, size, mean, std, scale).transforms:
        if isinstance(op, T.RandomResizedCrop):
            out.append(("crop", op.size, tuple(op.scale), tuple(round(r, 6) for r in op.ratio)))
        elif isinstance(op, T.RandomGrayscale):
            out.append(("gray", op.p))
        elif isinstance(op, T.ColorJitter):
            out.append(jitter(op, 1.0))
        elif isinstance(op, T.RandomApply):
            inner = op.transforms[0]
            if isinstance(inner, T.ColorJitter):
                out.append(jitter(inner, op.p))
            else:
                assert isinstance(inner, RandomGaussianBlur)
                out.append(("blur", op.p, inner.sigma))
        elif isinstance(op, T.RandomHorizontalFlip):
            out.append(("flip", op.p))
        elif isinstance(op, T.Normalize):
            out.append(("normalize", tuple(op.mean), tuple(op.std)))
    return out


def _kornia_ops(view):
    import kornia.augmentation as K

    def rng(v, centre):  # kornia's strength -> torchvision's factor range
        return None if not v else tuple(round(x, 6) for x in (centre - v, centre + v))

    out = []
    for op in view:
        g = getattr(op, "_param_generator", None)
        if isinstance(op, K.RandomResizedCrop):
            out.append(("crop", op.flags["size"], tuple(g.scale),
                        tuple(round(r, 6) for r in g.ratio)))
        elif isinstance(op, K.RandomGrayscale):
            out.append(("gray", op.p))
        elif isinstance(op, K.ColorJitter):
            out.append(("jitter", op.p, rng(g.brightness, 1), rng(g.contrast, 1),
                        rng(g.saturation, 1), rng(g.hue, 0)))
        elif isinstance(op, K.RandomGaussianBlur):
            out.append(("blur", op.p, tuple(float(s) for s in g.sigma)))
        elif isinstance(op, K.RandomHorizontalFlip):
            out.append(("flip", op.p))
        elif isinstance(op, K.Normalize):
            out.append(("normalize", tuple(op.flags["mean"].tolist()),
                        tuple(op.flags["std"].tolist())))
    return out


@pytest.mark.parametrize("preset", ["v1", "v2", "v2_small", "v2_grey"])
def test_batch_views__every_op_matches_the_per_image_reference(preset):
    # the batched kornia preset and the per-image torchvision recipe of the MoCo papers: the
    # same ops in the same order with the same parameters (probabilities, ranges, crop, stats)
    mean, std = (0.5, 0.25, 0.125), (0.5, 0.5, 0.25)
    if preset == "v2_grey":
        mean, std = (0.5,), (0.25,)
    ref = _ref_ops(preset, 24, mean, std, 0.3)
    got = _kornia_ops(build_batch_view(preset, 24, mean, std, 0.3))
    assert got == ref
    assert [r[0] for r in ref][0] == "crop" and ref[-1][0] == "normalize"
