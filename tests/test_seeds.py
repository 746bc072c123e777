import hashlib

from pipeline.seeds import batch_seed, derive_seed


def _blake_ref(text: str) -> int:
    # the definition written out: BLAKE2b with an 8-byte digest, little-endian, shifted right 1
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


def test_derive_seed__the_documented_hash_of_the_joined_parts():
    assert derive_seed("epoch-order", 0, 3) == _blake_ref("epoch-order|0|3")
    assert derive_seed(1, "k") == derive_seed("1", "k")  # str() of each part is hashed
    assert derive_seed(1, 2) != derive_seed(12) and derive_seed(1, 2) != derive_seed(2, 1)


def test_batch_seed__equals_derive_seed_of_seed_epoch_step_rank_and_is_63_bits():
    assert batch_seed(0, 1, 2, 3) == _blake_ref("0|1|2|3")
    seeds = {batch_seed(0, e, s, r) for e in range(3) for s in range(50) for r in range(2)}
    assert len(seeds) == 300 and all(0 <= x < 2**63 for x in seeds)
