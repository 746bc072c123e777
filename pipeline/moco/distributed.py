"""torch.distributed helpers for MoCo: rank queries, gathering without gradient, shuffle BN.

Every function works without an initialised process group (one process: rank 0 of 1, gather is
the identity) and with any backend (gloo on CPU, NCCL on CUDA); tensors stay on the device of
the inputs. All collectives assume every rank passes a tensor of the SAME shape (the training
loader yields equal batches on every rank); otherwise ``all_gather`` fails or hangs.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist


def is_dist() -> bool:
    """True when a torch.distributed process group is initialised."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's global rank (0 without a process group)."""
    return dist.get_rank() if is_dist() else 0


def world_size() -> int:
    """Number of processes (1 without a process group)."""
    return dist.get_world_size() if is_dist() else 1


def is_main() -> bool:
    """True on rank 0 (the process that logs and writes outputs)."""
    return rank() == 0


@torch.no_grad()
def concat_all_gather(t: torch.Tensor) -> torch.Tensor:
    """Concatenate ``t`` from all ranks along dim 0, in rank order, WITHOUT gradient.

    Args:
        t: ``(N, ...)`` tensor, the same shape on every rank.

    Returns:
        ``(world_size * N, ...)``; rows ``r*N:(r+1)*N`` come from rank ``r``. Without a process
        group (or with one process) ``t`` itself, detached.
    """
    if world_size() == 1:
        return t.detach()
    parts = [torch.empty_like(t) for _ in range(world_size())]
    dist.all_gather(parts, t.detach().contiguous())
    return torch.cat(parts, dim=0)


@torch.no_grad()
def ranks_identical(*tensors: torch.Tensor) -> bool:
    """Whether every rank holds bit-identical ``tensors`` (e.g. the ``(D, K)`` queue, its pointer).

    Each rank hashes its tensors (sha256 over dtype, shape and bytes, in the order given) and
    the digests of all ranks are gathered: a single flipped bit on one rank makes it False on
    every rank. A collective: every rank must call it, with the same number of tensors.
    Without a process group (or with one process) there is nothing to compare: True.

    Args:
        tensors: any shapes and dtypes; on the device the backend needs (CUDA for NCCL).

    Returns:
        True when the digests of all ranks are equal.
    """
    h = hashlib.sha256()
    for t in tensors:
        flat = t.detach().cpu().contiguous().reshape(-1)
        h.update(f"{flat.dtype} {tuple(t.shape)}\0".encode())
        h.update(flat.view(torch.uint8).numpy().tobytes())
    if world_size() == 1:
        return True
    device = tensors[0].device if tensors else torch.device("cpu")
    mine = torch.frombuffer(bytearray(h.digest()), dtype=torch.uint8).to(device)  # (32,)
    everyone = [torch.empty_like(mine) for _ in range(world_size())]
    dist.all_gather(everyone, mine)
    return all(torch.equal(d, mine) for d in everyone)


@torch.no_grad()
def batch_shuffle_ddp(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Shuffle BN across processes (He et al., CVPR 2020, Sec. 3.3).

    The batches of all ranks are gathered, rank 0 draws one permutation of the global batch
    and broadcasts it, and each rank keeps its slice of the permuted global batch: the keys a
    rank encodes mostly come from other ranks, so their BN statistics differ from the queries'.

    Without a process group this is a single-device shuffle (a permutation only, which does
    not prevent BN leakage: see :func:`pipeline.moco.batchnorm.check_bn_mode`).

    Args:
        x: ``(N, ...)`` local batch (e.g. ``(N, C, H, W)`` key images), the same ``N`` on every
            rank.

    Returns:
        ``(x_local_shuffled, idx_unshuffle)``: the ``(N, ...)`` slice of the shuffled global
        batch this rank encodes, and the ``(world_size * N,)`` long indices that undo the
        global permutation (identical on every rank; pass to :func:`batch_unshuffle_ddp`).
    """
    n_local = x.shape[0]
    x_all = concat_all_gather(x)  # (W*N, ...)
    n_all = x_all.shape[0]
    idx_shuffle = torch.randperm(n_all, device=x.device)  # (W*N,)
    if world_size() > 1:
        dist.broadcast(idx_shuffle, src=0)  # every rank uses rank 0's permutation
    idx_unshuffle = torch.argsort(idx_shuffle)
    mine = idx_shuffle.view(world_size(), n_local)[rank()]  # (N,) this rank's slice
    return x_all[mine], idx_unshuffle


@torch.no_grad()
def batch_unshuffle_ddp(x: torch.Tensor, idx_unshuffle: torch.Tensor) -> torch.Tensor:
    """Undo :func:`batch_shuffle_ddp` on its outputs (e.g. the ``(N, D)`` keys).

    Args:
        x: ``(N, ...)`` outputs for this rank's slice of the shuffled global batch.
        idx_unshuffle: ``(world_size * N,)`` indices from :func:`batch_shuffle_ddp`.

    Returns:
        ``(N, ...)`` outputs of this rank's ORIGINAL samples, in their original order.
    """
    n_local = x.shape[0]
    x_all = concat_all_gather(x)  # (W*N, ...) in shuffled order
    mine = idx_unshuffle.view(world_size(), n_local)[rank()]  # (N,)
    return x_all[mine]
