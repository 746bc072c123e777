"""The one seed derivation: an integer seed from any tuple of parts, stable everywhere.

Every random stream of the pipeline that must not depend on the process, the machine, the
number of workers or whether a run was resumed is seeded with :func:`derive_seed` of what
identifies it: the data order of an epoch ``("epoch-order", seed, epoch)``, a batch's views
``(seed, epoch, step, rank)`` (:func:`batch_seed`), a sample's crops, a probe batch's flips.
Never Python's salted ``hash()``.
"""

from __future__ import annotations

import hashlib


def derive_seed(*parts: object) -> int:
    """A 63-bit seed: BLAKE2b-64 of the parts joined by ``|``, little-endian, shifted right 1.

    Args:
        parts: ints and strings that identify the stream (their ``str()`` is hashed, so
            ``1`` and ``"1"`` give the same seed).

    Returns:
        An int in ``[0, 2**63)``.
    """
    msg = "|".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.blake2b(msg, digest_size=8).digest(), "little") >> 1


def batch_seed(seed: int, epoch: int, step: int, rank: int) -> int:
    """The augmentation seed of one training batch: ``derive_seed(seed, epoch, step, rank)``.

    Args:
        seed: the run's seed.
        epoch: 0-based epoch.
        step: global optimizer step (0-based).
        rank: process rank.
    """
    return derive_seed(int(seed), int(epoch), int(step), int(rank))
