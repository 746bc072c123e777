"""The momentum (key) encoder: creation, EMA update and momentum schedule.

MoCo (He et al., CVPR 2020, Eq. 2): ``θk ← m·θk + (1 − m)·θq``, with ``m`` the weight on the OLD
key-encoder value (0.999 in MoCo v1/v2, 0.99 in the MoCo CIFAR-10 demo). Only parameters are
averaged; the key encoder's BatchNorm buffers evolve through its own train-mode forward passes.
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

from pipeline.config import MSchedule
from pipeline.errors import InputError


def make_key_encoder(query_encoder: nn.Module) -> nn.Module:
    """Create the key encoder: an exact copy of the WHOLE query encoder (backbone and head).

    Args:
        query_encoder: the encoder trained by back-propagation.

    Returns:
        A deep copy (same parameters and buffers) whose parameters have ``requires_grad=False``;
        it must not be given to the optimizer.
    """
    key_encoder = copy.deepcopy(query_encoder)
    for p in key_encoder.parameters():
        p.requires_grad_(False)
    return key_encoder


@torch.no_grad()
def momentum_update(key_encoder: nn.Module, query_encoder: nn.Module, m: float) -> None:
    """In-place EMA of the parameters: ``θk ← m·θk + (1 − m)·θq`` (one fused ``lerp``).

    ``m = 1`` leaves the key encoder unchanged, ``m = 0`` copies the query encoder. Buffers
    (BatchNorm running statistics) are not touched. Call once per optimizer step.

    Args:
        key_encoder: the momentum encoder, updated in place.
        query_encoder: the encoder trained by back-propagation (same architecture).
        m: momentum in [0, 1], the weight on the old key-encoder value.

    Raises:
        ValueError: ``m`` outside [0, 1], or the two encoders' parameters do not pair up
            (different names or shapes).
    """
    if not 0.0 <= m <= 1.0:
        raise InputError(f"momentum_update: m (moco.m) must be in [0, 1], got {m}")
    named_k = list(key_encoder.named_parameters())
    named_q = list(query_encoder.named_parameters())
    if [(n, p.shape) for n, p in named_k] != [(n, p.shape) for n, p in named_q]:
        raise InputError("momentum_update: key and query encoders have different parameters")
    params_k = [p for _, p in named_k]
    params_q = [p.detach() for _, p in named_q]
    # lerp_(θk, θq, w) = θk + w·(θq − θk) = (1 − w)·θk + w·θq with w = 1 − m
    torch._foreach_lerp_(params_k, params_q, 1.0 - m)


def momentum_schedule(base_m: float, total_steps: int, kind: str = "constant") -> list[float]:
    """Per-step momentum values, precomputed for the whole run.

    * ``constant``: ``m_t = base_m`` (MoCo v1/v2).
    * ``cosine``: ``m_t = 1 − (1 − base_m)·(cos(π·t/T) + 1)/2`` for ``t = 0 … T−1`` (BYOL, MoCo
      v3): starts at ``base_m`` and rises towards 1; the last value is
      ``1 − (1 − base_m)·(cos(π·(T−1)/T) + 1)/2`` (1 would be reached at ``t = T``, after the
      last step).

    Args:
        base_m: momentum at step 0, in [0, 1].
        total_steps: number of optimizer steps ``T`` of the whole run (>= 1).
        kind: ``"constant"`` or ``"cosine"``.

    Returns:
        ``T`` floats; entry ``t`` is the momentum used at optimizer step ``t``.

    Raises:
        ValueError: ``base_m`` outside [0, 1], ``total_steps < 1`` or an unknown ``kind``.
    """
    if not 0.0 <= base_m <= 1.0:
        raise InputError(f"momentum_schedule: base_m (moco.m) must be in [0, 1], got {base_m}")
    if total_steps < 1:
        raise InputError(f"momentum_schedule: total_steps must be >= 1, got {total_steps}")
    if MSchedule.parse(kind, "moco.m_schedule") == MSchedule.constant:
        schedule = [float(base_m)] * total_steps
    else:
        schedule = [
            1.0 - (1.0 - base_m) * (math.cos(math.pi * t / total_steps) + 1.0) / 2.0
            for t in range(total_steps)
        ]
    assert len(schedule) == total_steps
    return schedule
