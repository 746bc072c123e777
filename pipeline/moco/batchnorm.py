"""BatchNorm without "cheating": split BN and single-device batch shuffling.

He et al. (CVPR 2020, Sec. 3.3) observe that per-device BN lets a query find its positive key
through the batch statistics both share. Their remedy on 8 GPUs is *shuffling BN*: the keys are
encoded in a shuffled order so the query and its key see different BN statistics. On ONE device
the MoCo CIFAR-10 demo imitates this with :class:`SplitBatchNorm2d` (8 groups with separate
statistics, "simulating 8 GPUs") plus a random permutation of the key batch. The DDP version of
the shuffle lives in :mod:`pipeline.moco.distributed`.

BN modes (``moco.bn``, exclusive):

* ``split``: SplitBatchNorm2d with ``bn_splits`` groups in both encoders + single-device shuffle
  of the keys (each rank shuffles its own batch when several processes run).
* ``shuffle``: plain BN per process + DDP shuffle across processes (needs > 1 process).
* ``sync``: SyncBatchNorm (statistics over the global batch: a positive cannot be singled out
  through the statistics any more than a negative; shuffling is pointless), needs > 1 process.
* ``none``: plain BN, no shuffle (leaks; for ablations only).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.config import BnMode, MocoParams
from pipeline.errors import InputError


class SplitBatchNorm2d(nn.BatchNorm2d):
    """BatchNorm2d that, in training, normalises ``num_splits`` groups of the batch separately.

    Group ``g`` holds samples ``g, g + S, g + 2S, …`` (an interleaved split, which needs no
    copy). Each group is normalised with its own mean and biased variance; the running
    statistics are updated with the MEAN over groups of each group's batch mean and unbiased
    variance (one momentum step per forward, as one BN layer per device followed by averaging
    would). In eval mode (or with ``track_running_stats=False`` in eval) it is exactly
    :class:`torch.nn.BatchNorm2d`. The state-dict keys are those of ``BatchNorm2d``.

    Args:
        num_features: channels ``C``.
        num_splits: groups ``S`` (8 in the MoCo CIFAR-10 demo); 1 equals plain BatchNorm2d.
        **kwargs: as for :class:`torch.nn.BatchNorm2d` (eps, momentum, affine, …).

    Raises:
        ValueError: ``num_splits < 1``.
    """

    def __init__(self, num_features: int, num_splits: int, **kwargs) -> None:
        super().__init__(num_features, **kwargs)
        if num_splits < 1:
            raise InputError(f"SplitBatchNorm2d: bn_splits must be >= 1, got {num_splits}")
        self.num_splits = num_splits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise ``x``.

        Args:
            x: ``(N, C, H, W)``; in training ``N`` must be a multiple of ``num_splits``.

        Returns:
            ``(N, C, H, W)``, same dtype as ``x``.

        Raises:
            ValueError: in training, ``N`` is not a multiple of ``num_splits``.
        """
        if not self.training or self.num_splits == 1:
            return super().forward(x)
        self._check_input_dim(x)
        n, c, h, w = x.shape
        s = self.num_splits
        if n % s != 0:
            raise InputError(
                f"SplitBatchNorm2d: the batch of {n} images is not divisible by "
                f"bn_splits (moco.bn_splits) = {s}; use a per-rank batch that is a multiple of it"
            )
        factor = 0.0 if self.momentum is None else self.momentum
        if self.track_running_stats:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average, as nn.BatchNorm2d
                factor = 1.0 / float(self.num_batches_tracked)
        if torch.compiler.is_compiling() and x.device.type == "cpu":
            return self._grouped_stats(x, factor)
        # view sample i*S + g as channel g*C + c of an (N/S)-sample batch: group g = its channels
        grouped = x.reshape(n // s, s * c, h, w)  # (N/S, S*C, H, W), no copy
        weight = self.weight.repeat(s) if self.affine else None
        bias = self.bias.repeat(s) if self.affine else None
        if self.track_running_stats:
            mean_g = self.running_mean.repeat(s)  # (S*C,), updated in place by batch_norm
            var_g = self.running_var.repeat(s)
            y = F.batch_norm(grouped, mean_g, var_g, weight, bias, True, factor, self.eps)
            with torch.no_grad():
                self.running_mean.copy_(mean_g.view(s, c).mean(dim=0))
                self.running_var.copy_(var_g.view(s, c).mean(dim=0))
        else:
            y = F.batch_norm(grouped, None, None, weight, bias, True, 0.0, self.eps)
        return y.reshape(n, c, h, w)

    def _grouped_stats(self, x: torch.Tensor, factor: float) -> torch.Tensor:
        """The training forward under ``torch.compile``: the same normalisation, in plain ops.

        The eager path merges groups and channels into one ``(N/S, S*C, H, W)`` batch for
        ``F.batch_norm``; inductor composes that reshape's index arithmetic through every BN
        layer of the backward, and lowering a ResNet-18's backward then spends minutes in sympy
        (108 s of CPU for one width-16 encoder vs 18 s with plain BN, 2 cores, torch 2.14).
        Here the batch is only split, ``(N, C, H, W)`` -> ``(N/S, S, C, H, W)``, and the group
        statistics come from ``var_mean`` (computed in at least fp32, as inductor's own
        ``batch_norm`` decomposition does). Equal to the eager path up to float rounding.

        CPU only (``benchmarks/compile_cold.py``, 2 cores, width 16, one thread): the first
        compiled step takes 134-139 s instead of 260-281 s, later steps 29-33 ms instead of
        24-31 ms, so a run comes out ahead for at least ~25,000 steps (1.6M images at batch
        64), past the 1M images at which ``pretrain.compile: auto`` starts compiling on CPU.
        On CUDA, where neither cost is measured, compiled code traces the eager form.

        Args:
            x: ``(N, C, H, W)``, ``N`` a multiple of ``num_splits``.
            factor: the running-statistics momentum of this step.

        Returns:
            ``(N, C, H, W)``, same dtype as ``x``.
        """
        n, c, h, w = x.shape
        s = self.num_splits
        count = (n // s) * h * w  # values per group and channel
        if count == 1:  # F.batch_norm's own refusal, in its words
            raise ValueError("Expected more than 1 value per channel when training, got input "
                             f"size {(n // s, s * c, h, w)}")
        xg = x.reshape(n // s, s, c, h, w).to(torch.promote_types(x.dtype, torch.float32))
        var, mean = torch.var_mean(xg, dim=(0, 3, 4), correction=0, keepdim=True)  # (1, S, C, 1, 1)
        y = (xg - mean) * torch.rsqrt(var + self.eps)
        if self.affine:
            y = y * self.weight.view(1, 1, c, 1, 1) + self.bias.view(1, 1, c, 1, 1)
        if self.track_running_stats:
            with torch.no_grad():
                batch_mean = mean.view(s, c).mean(dim=0)
                batch_var = (var.view(s, c) * (count / (count - 1))).mean(dim=0)  # unbiased
                self.running_mean.mul_(1 - factor).add_(batch_mean, alpha=factor)
                self.running_var.mul_(1 - factor).add_(batch_var, alpha=factor)
        return y.reshape(n, c, h, w).to(x.dtype)

    def extra_repr(self) -> str:
        """Extra text for ``repr``: BN settings plus ``num_splits``."""
        return super().extra_repr() + f", num_splits={self.num_splits}"


def _bn_kwargs(bn: nn.modules.batchnorm._BatchNorm) -> dict:
    return {
        "eps": bn.eps,
        "momentum": bn.momentum,
        "affine": bn.affine,
        "track_running_stats": bn.track_running_stats,
    }


def _copy_state(src: nn.Module, dst: nn.Module) -> nn.Module:
    ref = next((t for t in src.state_dict().values() if t.is_floating_point()), None)
    if ref is not None:
        dst.to(device=ref.device, dtype=ref.dtype)
    dst.load_state_dict(src.state_dict())
    dst.train(src.training)
    if src.affine:
        dst.weight.requires_grad_(src.weight.requires_grad)
        dst.bias.requires_grad_(src.bias.requires_grad)
    return dst


def convert_split_bn(module: nn.Module, num_splits: int) -> nn.Module:
    """Replace every ``BatchNorm2d`` (and SyncBatchNorm) in ``module`` by :class:`SplitBatchNorm2d`.

    Weights and buffers are copied. ``module`` is modified in place where possible.

    Args:
        module: any module (e.g. a ResNet backbone).
        num_splits: groups ``S`` for every converted layer.

    Returns:
        The converted module (a new object only if ``module`` itself is a BN layer).

    Raises:
        ValueError: ``num_splits < 1``.
    """
    if isinstance(module, (nn.BatchNorm2d, nn.SyncBatchNorm)):
        if isinstance(module, SplitBatchNorm2d):
            module.num_splits = num_splits
            return module
        new = SplitBatchNorm2d(module.num_features, num_splits, **_bn_kwargs(module))
        return _copy_state(module, new)
    if num_splits < 1:
        raise InputError(f"convert_split_bn: bn_splits must be >= 1, got {num_splits}")
    for name, child in module.named_children():
        module.add_module(name, convert_split_bn(child, num_splits))
    return module


def revert_split_bn(module: nn.Module) -> nn.Module:
    """Replace every SplitBatchNorm2d and SyncBatchNorm by a plain ``nn.BatchNorm2d``.

    For export and evaluation: weights and buffers are copied, so eval-mode outputs are
    unchanged. ``module`` is modified in place where possible.

    Args:
        module: a module that may contain split or synchronised BN layers.

    Returns:
        The module with only plain ``BatchNorm2d`` layers.
    """
    if isinstance(module, (SplitBatchNorm2d, nn.SyncBatchNorm)):
        new = nn.BatchNorm2d(module.num_features, **_bn_kwargs(module))
        return _copy_state(module, new)
    for name, child in module.named_children():
        module.add_module(name, revert_split_bn(child))
    return module


# the one default of moco.bn_splits: params.yaml's schema (pipeline.config.MocoParams)
DEFAULT_BN_SPLITS: int = MocoParams.model_fields["bn_splits"].default


def prepare_bn(module: nn.Module, bn: str, bn_splits: int = DEFAULT_BN_SPLITS) -> nn.Module:
    """Convert the BN layers of ``module`` for a BN mode (done by :class:`MoCo` at construction).

    ``split`` → :class:`SplitBatchNorm2d` with ``bn_splits`` groups; ``sync`` →
    :class:`torch.nn.SyncBatchNorm` (works before the process group exists; must happen before
    wrapping in DDP); ``shuffle`` / ``none`` → unchanged.

    Args:
        module: the backbone (or whole encoder).
        bn: one of ``split``, ``shuffle``, ``sync``, ``none`` (``moco.bn``).
        bn_splits: groups for ``split`` (``moco.bn_splits``).

    Returns:
        The converted module.

    Raises:
        ValueError: unknown ``bn`` or ``bn_splits < 1``.
    """
    bn = BnMode.parse(bn, "moco.bn")
    if bn == "split":
        return convert_split_bn(module, bn_splits)
    if bn == "sync":
        return nn.SyncBatchNorm.convert_sync_batchnorm(module)
    return module


def check_bn_mode(bn: str, batch_per_rank: int | None, bn_splits: int, world_size: int) -> None:
    """Validate a BN mode for a run BEFORE any expensive work (the trainer calls this).

    Rules:

    * ``split``: ``batch_per_rank`` must be a multiple of ``bn_splits``. Allowed with any
      number of processes (each rank splits and shuffles its own batch).
    * ``shuffle``: needs ``world_size > 1``. On one process a shuffle only permutes the batch,
      and a plain BN's statistics are permutation-invariant, so it would silently leak; use
      ``split`` on one device.
    * ``sync``: needs ``world_size > 1`` (on one process SyncBN is plain BN, which leaks) and a
      device SyncBN supports (CUDA): torch's SyncBatchNorm rejects CPU tensors in training.
    * ``none``: always allowed (plain BN, no shuffle: leaks, for ablations).

    Args:
        bn: the mode (``moco.bn``).
        batch_per_rank: images per process per step (global batch / world size); ``None``
            skips the batch check (e.g. at model construction, before the batch is known).
        bn_splits: ``moco.bn_splits``.
        world_size: number of processes.

    Raises:
        ValueError: an invalid combination, with a message naming the keys.
    """
    bn = BnMode.parse(bn, "moco.bn")
    if (batch_per_rank is not None and batch_per_rank < 1) or world_size < 1:
        raise InputError(
            f"batch per rank ({batch_per_rank}) and world size ({world_size}) must be >= 1"
        )
    if bn == "split":
        if bn_splits < 1 or (batch_per_rank is not None and batch_per_rank % bn_splits != 0):
            raise InputError(
                f"moco.bn='split' needs a per-rank batch divisible by moco.bn_splits: the batch "
                f"per rank is {batch_per_rank}, bn_splits is {bn_splits}"
            )
    elif bn in ("shuffle", "sync") and world_size == 1:
        raise InputError(
            f"moco.bn={bn!r} needs several processes (DDP), but world_size is 1; on one device "
            "use moco.bn='split' (SplitBatchNorm + shuffle, as the MoCo CIFAR-10 demo)"
        )


@torch.no_grad()
def shuffle_batch(
    x: torch.Tensor, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Randomly permute a batch on one device (for split BN).

    Args:
        x: ``(N, ...)`` batch.
        generator: optional RNG on ``x``'s device (default: the global RNG of that device).

    Returns:
        ``(x[idx_shuffle], idx_unshuffle)``: the permuted ``(N, ...)`` batch and the ``(N,)``
        long indices that undo the permutation (see :func:`unshuffle`).
    """
    idx_shuffle = torch.randperm(x.shape[0], device=x.device, generator=generator)
    idx_unshuffle = torch.argsort(idx_shuffle)
    return x[idx_shuffle], idx_unshuffle


def unshuffle(x: torch.Tensor, idx_unshuffle: torch.Tensor) -> torch.Tensor:
    """Undo :func:`shuffle_batch`: ``unshuffle(x[idx_shuffle], idx_unshuffle) == x``.

    Args:
        x: ``(N, ...)`` tensor in shuffled order (e.g. ``(N, D)`` keys).
        idx_unshuffle: ``(N,)`` indices returned by :func:`shuffle_batch`.

    Returns:
        ``(N, ...)`` in the original order.
    """
    return x[idx_unshuffle]
