"""MoCo core: queue, momentum encoder, InfoNCE, BN handling, backbones and the MoCo module."""
