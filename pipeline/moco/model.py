"""MoCo: Momentum Contrast (He et al., CVPR 2020; MoCo v2: Chen et al., 2020).

Algorithm 1 of the paper, one training step::

    q = normalize(f_q(x_q))                    # queries: (N, D)
    with no_grad:
        θk ← m·θk + (1 − m)·θq                 # momentum update, once per step
        k = normalize(f_k(shuffle(x_k)))       # keys: (N, D), shuffled for BN
        k = unshuffle(k)
    loss = InfoNCE(q, k, queue)                # negatives: the queue BEFORE this step
    enqueue(gather(k)); dequeue the oldest     # identical queue on every rank
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.config import BnMode
from pipeline.errors import InputError
from pipeline.moco.backbones import export_state_dict
from pipeline.moco.batchnorm import (
    DEFAULT_BN_SPLITS,
    check_bn_mode,
    prepare_bn,
    shuffle_batch,
    unshuffle,
)
from pipeline.moco.distributed import batch_shuffle_ddp, batch_unshuffle_ddp, concat_all_gather
from pipeline.moco.loss import info_nce, instance_accuracy
from pipeline.moco.momentum import make_key_encoder, momentum_update
from pipeline.moco.queue import KeyQueue


@dataclass
class MocoOutput:
    """What one MoCo forward returns.

    Attributes:
        loss: scalar float32 loss to back-propagate (symmetric: the SUM of the two terms).
        logits: ``(N, 1 + K)`` float32 logits, positive at column 0 (symmetric: ``(2N, 1 + K)``,
            the rows of the term with queries from ``im_q`` first).
        top1: 0-dim tensor, instance accuracy in percent (over all rows of ``logits``).
        top5: 0-dim tensor, top-5 instance accuracy in percent.
        q: ``(N, D)`` (symmetric ``(2N, D)``) normalised queries, with gradient.
        k: ``(N, D)`` (symmetric ``(2N, D)``) normalised local keys, in input order.
    """

    loss: torch.Tensor
    logits: torch.Tensor
    top1: torch.Tensor
    top5: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor


def _out_dim(head: nn.Module) -> int:
    linears = [m for m in head.modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise InputError(
            "MoCo: cannot infer the key dimension D from the head (no nn.Linear); pass dim="
        )
    return linears[-1].out_features


class MoCo(nn.Module):
    """Momentum Contrast with a queue of negative keys.

    ``encoder_q`` = ``Sequential(backbone, head)`` (``encoder_q.backbone`` is the network
    exported after pretraining); ``encoder_k`` is an exact copy of the whole query encoder
    (backbone and head), without gradient and outside the optimizer (use
    :meth:`trainable_parameters`). The BN layers of the backbone are converted for ``bn``
    BEFORE the copy, so both encoders use the same kind of BN.

    Args:
        backbone: ``(N, C, H, W)`` → ``(N, F)`` network (e.g. from ``build_backbone``).
        head: ``(N, F)`` → ``(N, D)`` projection head (e.g. from ``build_head``).
        K: queue length (``moco.K``; 65536 MoCo v1/v2, 4096 CIFAR-10 demo).
        m: default momentum (``moco.m``; 0.999 MoCo v1/v2, 0.99 CIFAR-10 demo), overridden
            per step by ``forward(..., m=schedule[step])``.
        T: temperature (``moco.T``; 0.07 v1, 0.2 v2, 0.1 CIFAR-10 demo).
        symmetric: also use ``im_k`` as queries against keys of ``im_q`` (MoCo CIFAR-10 demo);
            the loss is the SUM of both terms, as in the demo, whose lr (0.06 per 512) was
            tuned with that scale; both terms use the pre-step queue and the 2N keys are
            enqueued once.
        bn: ``split`` (one device: SplitBatchNorm2d + shuffle), ``shuffle`` (DDP shuffle BN),
            ``sync`` (SyncBatchNorm, no shuffle) or ``none`` (plain BN, leaks). See
            :func:`pipeline.moco.batchnorm.check_bn_mode` for the valid combinations.
        bn_splits: groups of SplitBatchNorm2d for ``bn='split'`` (default: ``moco.bn_splits``'s
            in :class:`pipeline.config.MocoParams`; the MoCo CIFAR demo uses 8).
        dim: key dimension ``D``; default: ``out_features`` of the head's last ``nn.Linear``.
        world_size: number of processes of the run; when given, ``bn`` is validated against it
            (``check_bn_mode``: ``shuffle``/``sync`` need > 1). ``None`` skips that check.

    Raises:
        ValueError: invalid ``K``, ``m``, ``T``, ``bn`` or ``bn_splits``, or a BN mode that
            cannot work with ``world_size``.
    """

    def __init__(
        self,
        backbone: nn.Module,
        head: nn.Module,
        *,
        K: int,
        m: float,
        T: float,
        symmetric: bool = False,
        bn: str = "split",
        bn_splits: int = DEFAULT_BN_SPLITS,
        dim: int | None = None,
        world_size: int | None = None,
    ) -> None:
        super().__init__()
        if not 0.0 <= m <= 1.0:
            raise InputError(f"moco.m must be in [0, 1], got {m}")
        if not T > 0:
            raise InputError(f"moco.T must be > 0, got {T}")
        bn = BnMode.parse(bn, "moco.bn")
        if bn_splits < 1:
            raise InputError(f"moco.bn_splits must be >= 1, got {bn_splits}")
        if world_size is not None:
            check_bn_mode(bn, None, bn_splits, world_size)
        self.m, self.T, self.symmetric = float(m), float(T), bool(symmetric)
        self.bn, self.bn_splits = bn, int(bn_splits)
        backbone = prepare_bn(backbone, bn, bn_splits)
        self.encoder_q = nn.Sequential(OrderedDict(backbone=backbone, head=head))
        self.encoder_k = make_key_encoder(self.encoder_q)
        self.queue = KeyQueue(dim if dim is not None else _out_dim(head), K)

    def trainable_parameters(self) -> list[nn.Parameter]:
        """The parameters the optimizer updates: the query encoder's (never the key encoder's)."""
        return [p for p in self.encoder_q.parameters() if p.requires_grad]

    @torch.no_grad()
    def _momentum_update_key_encoder(self, m: float) -> None:
        """θk ← m·θk + (1 − m)·θq on the parameters (Eq. 2)."""
        momentum_update(self.encoder_k, self.encoder_q, m)

    @torch.no_grad()
    def _batch_shuffle(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Shuffle the key images for BN: local for split BN, global for shuffle BN."""
        if self.bn == "split":
            return shuffle_batch(x)
        if self.bn == "shuffle":
            return batch_shuffle_ddp(x)
        return x, None  # sync / none: no shuffle

    @torch.no_grad()
    def _batch_unshuffle(self, k: torch.Tensor, idx_unshuffle: torch.Tensor | None) -> torch.Tensor:
        """Undo :meth:`_batch_shuffle` on the ``(N, D)`` keys."""
        if idx_unshuffle is None:
            return k
        if self.bn == "split":
            return unshuffle(k, idx_unshuffle)
        return batch_unshuffle_ddp(k, idx_unshuffle)

    @torch.no_grad()
    def _keys(self, im_k: torch.Tensor) -> torch.Tensor:
        """``(N, C, H, W)`` key images → ``(N, D)`` normalised keys, in input order."""
        x, idx_unshuffle = self._batch_shuffle(im_k)
        k = F.normalize(self.encoder_k(x), dim=1)  # keys: (N, D)
        return self._batch_unshuffle(k, idx_unshuffle)

    @torch.no_grad()
    def _dequeue_and_enqueue(self, keys: torch.Tensor, step: int) -> None:
        """Enqueue the keys of ALL ranks (same order everywhere) and drop the oldest."""
        self.queue.enqueue(concat_all_gather(keys), step)  # (W*N, D)

    def forward(
        self, im_q: torch.Tensor, im_k: torch.Tensor, m: float | None = None, step: int = 0,
        im_small: Sequence[torch.Tensor] = (),
    ) -> MocoOutput:
        """One MoCo step on a batch of image pairs (call once per optimizer step).

        Args:
            im_q: ``(N, C, H, W)`` query views.
            im_k: ``(N, C, H, W)`` key views of the same images (row ``i`` pairs with
                ``im_q[i]``).
            m: momentum for this step (``momentum_schedule(...)[step]``); default ``self.m``.
            step: optimizer step, recorded in the queue (``KeyQueue.written_step``).
            im_small: multi-crop: extra ``(N, C, s, s)`` small query views of the same images
                (SwAV/DINO-style local crops). Each is encoded by the query encoder only and
                contrasted with the key of its image and the queue; the loss is the mean of
                the ``1 + len(im_small)`` InfoNCE terms. Only ``im_k``'s keys are enqueued.

        Returns:
            :class:`MocoOutput` (loss, logits and instance accuracy of the full-size queries,
            q, k).

        Raises:
            ValueError: mismatched batches, small crops with ``symmetric``, or
                (``bn='split'``, training) a batch not divisible by ``bn_splits``.
        """
        if im_q.shape[0] != im_k.shape[0] or any(x.shape[0] != im_q.shape[0] for x in im_small):
            raise InputError(
                f"MoCo: im_q, im_k and im_small must have the same batch size; got "
                f"{im_q.shape[0]}, {im_k.shape[0]} and {[x.shape[0] for x in im_small]}"
            )
        if im_small and self.symmetric:
            raise InputError("MoCo: small crops (augment.small_crops) with moco.symmetric are "
                             "not supported")
        m = self.m if m is None else m
        negatives = self.queue.negatives()  # (D, K), the dictionary BEFORE this step
        q = F.normalize(self.encoder_q(im_q), dim=1)  # queries: (N, D)
        with torch.no_grad():
            self._momentum_update_key_encoder(m)
            k = self._keys(im_k)  # keys: (N, D)
        if self.symmetric:
            q2 = F.normalize(self.encoder_q(im_k), dim=1)  # queries from the key view: (N, D)
            with torch.no_grad():
                k2 = self._keys(im_q)  # keys of the query view: (N, D)
            loss_12, logits_12 = info_nce(q, k, negatives, self.T)
            loss_21, logits_21 = info_nce(q2, k2, negatives, self.T)
            loss = loss_12 + loss_21
            logits = torch.cat([logits_12, logits_21], dim=0)  # (2N, 1 + K)
            q, k = torch.cat([q, q2], dim=0), torch.cat([k, k2], dim=0)  # (2N, D)
        else:
            loss, logits = info_nce(q, k, negatives, self.T)  # logits: (N, 1 + K)
            for x in im_small:  # each small crop: its image's key, the same negatives
                q_s = F.normalize(self.encoder_q(x), dim=1)  # (N, D)
                loss = loss + info_nce(q_s, k, negatives, self.T)[0]
            loss = loss / (1 + len(im_small))
        self._dequeue_and_enqueue(k, step)
        top1, top5 = instance_accuracy(logits.detach(), topk=(1, 5))
        return MocoOutput(loss=loss, logits=logits, top1=top1, top5=top5, q=q, k=k.detach())

    def export_backbone(self) -> dict[str, torch.Tensor]:
        """The QUERY backbone as a plain torchvision-style ``state_dict`` (CPU, no ``fc.*``).

        Split/Sync BN layers have plain ``BatchNorm2d`` keys; it loads into
        ``build_backbone(...)`` with a real ``fc`` leaving only ``fc.weight``/``fc.bias`` missing.
        """
        return export_state_dict(self.encoder_q.backbone)
