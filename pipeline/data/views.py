"""Every image view the pipeline makes: MoCo's training views, the evaluation transform, crops.

**Training views** (:func:`build_batch_view`, :class:`BatchTwoCrop`): the loaders yield uint8
batches ``(B, C, H, W)``, and the query and key views are made per batch on the training device
(CPU or CUDA) with kornia, random parameters drawn per sample. The presets keep the published
parameters and order:

* ``v1`` (He et al., CVPR 2020, Sec. 4.1; official ``main_moco.py``): RandomResizedCrop(scale
  ``crop_min_scale``-1, ratio 3/4-4/3), RandomGrayscale(0.2), ColorJitter(0.4, 0.4, 0.4, 0.4)
  always, horizontal flip.
* ``v2`` (Chen et al., 2020, "aug+"; ``main_moco.py --aug-plus``): RandomResizedCrop,
  ColorJitter(0.4, 0.4, 0.4, 0.1) with p=0.8, RandomGrayscale(0.2), Gaussian blur
  σ ∈ [0.1, 2] px with p=0.5, horizontal flip.
* ``v2_small``: ``v2`` without blur, for images ≤ 64 px (the MoCo CIFAR-10 demo blurs nothing).
* ``v2_grey``: for 1-channel images: RandomResizedCrop, ColorJitter(brightness 0.4, contrast
  0.4) with p=0.8, horizontal flip (saturation, hue and grayscale do nothing to a grey image).

Every preset ends with Normalize(mean, std). Two documented differences from the per-image
torchvision recipe (``tests/data/reference_views.py`` keeps it as the test reference): kornia
draws the order of ColorJitter's four ops once per batch (torchvision: per image; for
``v2_grey``'s brightness and contrast the order does not matter up to clamping), and the blur is
a 13-tap Gaussian kernel (covers ±3σ at σ = 2) where the official code uses PIL's radius-σ blur.

**Per-image crops** (:class:`SeededRandomResizedCrop`): shards built with ``data.max_side``
hold whole images of different sizes, which cannot be stacked before cropping; the train loader
cuts their views in the workers with torchvision's RandomResizedCrop, seeded per sample, and
every later op stays batched on the device (``build_batch_view(..., crop=False)``).

**Evaluation** (:func:`build_eval_transform`): the deterministic per-image transform of the kNN
bank, the features and the linear probe's test images.

Reproducibility: the views are a pure function of the batch and a seed
(:func:`pipeline.seeds.batch_seed`): kornia and torchvision draw from the torch RNG, which is
forked and seeded around each call, so the global RNG is untouched and a resumed run makes the
same views as an uninterrupted one.
"""

from __future__ import annotations

from collections.abc import Sequence

import kornia.augmentation as K
import torch
from PIL import Image
from torch import nn
from torchvision import transforms as T

from pipeline.config import AugPreset
from pipeline.data.jpeg import DRAFT_SCALES, Box
from pipeline.errors import InputError

BLUR_KERNEL = 13  # 2 * ceil(3 * sigma_max) + 1 for sigma_max = 2 px (MoCo v2)
EVAL_CROP_RATIO = 0.875  # resize 256 -> center-crop 224, the ImageNet evaluation protocol
CROP_RATIO = (3 / 4, 4 / 3)  # RandomResizedCrop's aspect-ratio range (torchvision, MoCo)


def _check_stats(mean: Sequence[float], std: Sequence[float]) -> None:
    if len(mean) != len(std) or not mean:
        raise InputError(f"mean and std must have one entry per channel, got {mean} and {std}")


def flip_normalize(mean: Sequence[float], std: Sequence[float]) -> nn.Sequential:
    """Horizontal flip (p = 0.5, per sample) then Normalize: the tail of every training view.

    Also the whole batch op of the linear probe's augment mode after its per-image crop (MoCo
    ``main_lincls.py``: RandomResizedCrop, flip, normalise).

    Args:
        mean: per-channel dataset mean, 0..1 scale.
        std: per-channel dataset standard deviation.

    Returns:
        A module ``(B, C, S, S)`` float in [0, 1] → normalised ``(B, C, S, S)``.

    Raises:
        ValueError: ``mean``/``std`` of different or zero length.
    """
    _check_stats(mean, std)
    return nn.Sequential(K.RandomHorizontalFlip(p=0.5),
                         K.Normalize(mean=torch.tensor(list(mean)), std=torch.tensor(list(std))))


def build_batch_view(preset: str, image_size: int, mean: Sequence[float], std: Sequence[float],
                     crop_min_scale: float = 0.2, crop: bool = True,
                     crop_max_scale: float = 1.0) -> nn.Sequential:
    """One random view of a float batch in [0, 1], per-sample parameters.

    Args:
        preset: ``v1``, ``v2``, ``v2_small`` or ``v2_grey`` (``augment.preset``).
        image_size: side of the square output crop, in pixels.
        mean: per-channel dataset mean, in [0, 1] units.
        std: per-channel dataset standard deviation.
        crop_min_scale: RandomResizedCrop's lower area bound (0.2 in MoCo v1/v2).
        crop_max_scale: its upper bound (1 for the two global views; 0.4 for DINO's local
            crops, see ``augment.small_crop_max_scale``).
        crop: False for batches already cropped per image in the loader workers
            (variable-size shards, ``train_loader(crop=...)``): every op but the crop.

    Returns:
        A module ``(B, C, H, W)`` float in [0, 1] → ``(B, C, image_size, image_size)`` normalised.

    Raises:
        ValueError: unknown preset, ``crop_min_scale`` outside (0, 1], ``image_size < 1``, or
            ``mean``/``std`` of different or zero length.
    """
    preset = AugPreset.parse(preset, "augment.preset")
    if not 0 < crop_min_scale <= crop_max_scale <= 1:
        raise InputError(f"crop scale range must satisfy 0 < min <= max <= 1, got "
                         f"({crop_min_scale}, {crop_max_scale}) (augment.crop_min_scale)")
    if image_size < 1:
        raise InputError(f"image_size must be >= 1, got {image_size}")
    tail = flip_normalize(mean, std)
    rrc = K.RandomResizedCrop((image_size, image_size), scale=(crop_min_scale, crop_max_scale),
                              ratio=CROP_RATIO, cropping_mode="resample")
    if preset == AugPreset.v1:
        ops: list[nn.Module] = [rrc, K.RandomGrayscale(p=0.2),
                                K.ColorJitter(0.4, 0.4, 0.4, 0.4, p=1.0)]
    elif preset in (AugPreset.v2, AugPreset.v2_small):
        ops = [rrc, K.ColorJitter(0.4, 0.4, 0.4, 0.1, p=0.8), K.RandomGrayscale(p=0.2)]
        if preset == AugPreset.v2:
            ops.append(K.RandomGaussianBlur((BLUR_KERNEL, BLUR_KERNEL), (0.1, 2.0), p=0.5))
    else:  # v2_grey
        ops = [rrc, K.ColorJitter(brightness=0.4, contrast=0.4, p=0.8)]
    if not crop:
        ops = ops[1:]
    return nn.Sequential(*ops, *tail)


class BatchView:
    """A random view of a uint8 batch on the batch's device, reproducible from a seed.

    Args:
        view: a module from :func:`build_batch_view` or :func:`flip_normalize`.
        memory_format: layout of the returned views (``torch.channels_last`` when the model
            runs channels_last).
    """

    def __init__(self, view: nn.Module,
                 memory_format: torch.memory_format = torch.contiguous_format) -> None:
        self.view, self.memory_format = view, memory_format

    @torch.no_grad()
    def draw(self, batches: Sequence[torch.Tensor], seed: int) -> list[torch.Tensor]:
        """One view of each float batch, drawn in order under one forked, seeded torch RNG.

        Args:
            batches: ``(B, C, H, W)`` float tensors in [0, 1], all on one device.
            seed: e.g. :func:`pipeline.seeds.batch_seed` ``(seed, epoch, step, rank)``.

        Returns:
            The views, ``(B, C, S, S)`` float32 each.
        """
        device = batches[0].device
        devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices, device_type=device.type):
            torch.manual_seed(seed)
            views = [self.view(x) for x in batches]
        return [v.contiguous(memory_format=self.memory_format) for v in views]

    def __call__(self, images: torch.Tensor, seed: int) -> torch.Tensor:
        """One view of a ``(B, C, H, W)`` uint8 batch (see :meth:`draw`)."""
        _check_uint8(images, dims=(4,))
        return self.draw([images.float().div_(255)], seed)[0]


class BatchTwoCrop(BatchView):
    """MoCo's query and key views of one uint8 batch, and optional small query crops.

    The query is drawn first, then the key, then the small crops, all under one seeded RNG, so
    the two full-size views do not depend on whether small crops are made.

    Args:
        view: the full-size view (:func:`build_batch_view`).
        memory_format: layout of the returned views.
        small_view: the small crops' view (:func:`build_batch_view` at the small size and
            scale range), or None.
        small_crops: how many small crops per image (``augment.small_crops``).
    """

    def __init__(self, view: nn.Module,
                 memory_format: torch.memory_format = torch.contiguous_format,
                 small_view: nn.Module | None = None, small_crops: int = 0) -> None:
        super().__init__(view, memory_format)
        if small_crops and small_view is None:
            raise InputError("small_crops > 0 needs a small_view")
        self.small_view, self.small_crops = small_view, small_crops

    def __call__(self, images: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Draw the query and key views (:meth:`draw_all` without the small crops)."""
        q, k, _ = self.draw_all(images, seed)
        return q, k

    @torch.no_grad()
    def draw_all(self, images: torch.Tensor, seed: int
                 ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """Draw the query, the key and the small crops.

        Args:
            images: ``(B, C, H, W)`` uint8 on the training device, or ``(B, 2, C, S, S)``:
                the two views already cropped per image (then ``view`` has no crop).
            seed: e.g. :func:`pipeline.seeds.batch_seed` ``(seed, epoch, step, rank)``.

        Returns:
            ``(im_q, im_k, small)``: two ``(B, C, S, S)`` float32 tensors and a list of
            ``small_crops`` ``(B, C, s, s)`` ones, on the batch's device.

        Raises:
            ValueError: ``images`` is not such a uint8 tensor.
        """
        _check_uint8(images, dims=(4, 5))
        x = images.float().div_(255)
        xq, xk = (x[:, 0], x[:, 1]) if x.dim() == 5 else (x, x)
        device = x.device
        devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices, device_type=device.type):
            torch.manual_seed(seed)
            q, k = self.view(xq), self.view(xk)
            small = [self.small_view(x) for _ in range(self.small_crops)] if (
                self.small_crops) else []
        fmt = self.memory_format
        return (q.contiguous(memory_format=fmt), k.contiguous(memory_format=fmt),
                [v.contiguous(memory_format=fmt) for v in small])


def _check_uint8(images: torch.Tensor, dims: tuple[int, ...]) -> None:
    two = images.dim() == 5 and images.shape[1] == 2
    if images.dtype != torch.uint8 or not (images.dim() == 4 or (5 in dims and two)):
        shapes = "(B, C, H, W)" + (" or (B, 2, C, S, S)" if 5 in dims else "")
        raise InputError(f"expected a {shapes} uint8 batch, got {images.dtype} "
                         f"{tuple(images.shape)}")


class SeededRandomResizedCrop:
    """torchvision's ``RandomResizedCrop`` of a PIL image, as a pure function of a seed.

    The parameters come from torchvision's own search (``get_params``: up to 10 draws of an
    area fraction in ``scale`` and a log-uniform aspect ratio in ``ratio``, else a centre crop),
    drawn under a forked torch RNG seeded with ``seed``; the crop is resized to ``size x size``
    with bilinear antialiased resampling. The loader seeds it from ``(seed, epoch, position,
    view)``, so a crop does not depend on the number of ranks or workers.

    Args:
        size: output side in pixels (``data.image_size``).
        scale: range of the crop's area as a fraction of the image (MoCo: 0.2-1).
        ratio: range of the crop's aspect ratio w/h (torchvision: 3/4-4/3).

    Raises:
        ValueError: ``size < 1`` or a malformed range.
    """

    def __init__(self, size: int, scale: tuple[float, float] = (0.2, 1.0),
                 ratio: tuple[float, float] = CROP_RATIO) -> None:
        if size < 1:
            raise InputError(f"size must be >= 1, got {size}")
        if not 0 < scale[0] <= scale[1] <= 1:
            raise InputError(f"scale must satisfy 0 < low <= high <= 1, got {scale}")
        if not 0 < ratio[0] <= ratio[1]:
            raise InputError(f"ratio must satisfy 0 < low <= high, got {ratio}")
        self.crop = T.RandomResizedCrop(size, scale=tuple(scale), ratio=tuple(ratio),
                                        interpolation=T.InterpolationMode.BILINEAR,
                                        antialias=True)

    @property
    def size(self) -> int:
        """The output side in pixels."""
        return int(self.crop.size[0])

    def __call__(self, image: Image.Image, seed: int) -> Image.Image:
        """One ``size x size`` crop of ``image`` (same mode), resampled by PIL.

        The loader cuts the same boxes from uint8 tensors instead
        (:func:`pipeline.data.jpeg.cut_views`: torchvision's resize, within 1 of this one).
        """
        top, left, h, w = self.boxes(image.size, [seed])[0]
        return T.functional.resized_crop(image, top, left, h, w, [self.size, self.size],
                                         T.InterpolationMode.BILINEAR, antialias=True)

    def boxes(self, size: tuple[int, int], seeds: Sequence[int]) -> list[Box]:
        """The crop box of each seed, from the image's size alone (nothing is decoded).

        The draws are torchvision's ``RandomResizedCrop.get_params``, under a forked torch RNG
        seeded with each seed, as :meth:`__call__` has always drawn them.

        Args:
            size: ``(W, H)`` of the image as displayed (a JPEG's header:
                :func:`pipeline.data.external.upright_size`).
            seeds: one seed per view.

        Returns:
            ``(top, left, height, width)`` in pixels of the full image, one per seed.
        """
        w, h = size
        image = torch.empty(()).expand(1, h, w)  # get_params reads only its shape: no pixels
        out = []
        for seed in seeds:
            with torch.random.fork_rng(devices=[]):
                # the CPU generator only: the draws are CPU draws, and torch.manual_seed would
                # also queue a seed for every CUDA device, recording a Python stack each time
                # (~1 ms, a third of a photo's loader time, benchmarks/photo_loader.py)
                torch.default_generator.manual_seed(seed)
                out.append(tuple(int(v) for v in self.crop.get_params(
                    image, self.crop.scale, self.crop.ratio)))
        return out  # type: ignore[return-value]

    def draft_scale(self, boxes: Sequence[Box]) -> int:
        """The JPEG DCT reduction (1, 2, 4 or 8) that still gives every box ``size`` px a side.

        A JPEG decoded at 1/k (PIL ``draft``: libjpeg's scaled inverse DCT, much less work than
        a full decode) keeps at least as many pixels across each crop as the crop's output has,
        so no view is enlarged that a full decode would have shrunk. Needs every box's shorter
        side to be at least twice the target: 224 px views reduce only for boxes of 448 px and
        more (never in a 500 x 375 photo; often in a 12 MP one).

        Returns:
            The largest ``k`` in (8, 4, 2) with ``min(height, width) >= k * size`` for every
            box, else 1.
        """
        side = min(min(h, w) for _, _, h, w in boxes)
        return next((k for k in DRAFT_SCALES if side >= k * self.size), 1)


def build_eval_transform(image_size: int, mean: Sequence[float], std: Sequence[float]) -> T.Compose:
    """Deterministic transform for evaluation (kNN bank, features, linear probe test images).

    For ``image_size >= 128`` the ImageNet protocol: resize the shorter side to
    ``int(image_size / 0.875)`` (224 → 256) then center-crop ``image_size``. For small images
    resize the shorter side to ``image_size`` then center-crop (the identity for square images
    already of that size).

    Args:
        image_size: output side in pixels.
        mean: per-channel dataset mean.
        std: per-channel dataset standard deviation.

    Returns:
        A transform PIL image → ``(C, image_size, image_size)`` float32 tensor.

    Raises:
        ValueError: ``image_size < 1`` or ``mean``/``std`` of different lengths.
    """
    if image_size < 1:
        raise InputError(f"image_size must be >= 1, got {image_size}")
    _check_stats(mean, std)
    resize = int(image_size / EVAL_CROP_RATIO) if image_size >= 128 else image_size
    return T.Compose([T.Resize(resize), T.CenterCrop(image_size), T.ToTensor(),
                      T.Normalize(tuple(mean), tuple(std))])
