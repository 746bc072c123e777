"""MoCo core: queue, momentum encoder, InfoNCE, BN handling, backbones and the MoCo module."""

from pipeline.moco.backbones import (
    build_backbone,
    build_head,
    export_state_dict,
    known_backbones,
    register_backbone,
    resolve_small_stem,
)
from pipeline.moco.batchnorm import (
    BN_MODES,
    SplitBatchNorm2d,
    check_bn_mode,
    convert_split_bn,
    prepare_bn,
    revert_split_bn,
    shuffle_batch,
    unshuffle,
)
from pipeline.moco.loss import info_nce, instance_accuracy
from pipeline.moco.model import MoCo, MocoOutput
from pipeline.moco.momentum import make_key_encoder, momentum_schedule, momentum_update
from pipeline.moco.queue import KeyQueue

__all__ = [
    "BN_MODES",
    "KeyQueue",
    "MoCo",
    "MocoOutput",
    "SplitBatchNorm2d",
    "build_backbone",
    "build_head",
    "check_bn_mode",
    "convert_split_bn",
    "export_state_dict",
    "info_nce",
    "instance_accuracy",
    "known_backbones",
    "make_key_encoder",
    "momentum_schedule",
    "momentum_update",
    "prepare_bn",
    "register_backbone",
    "resolve_small_stem",
    "revert_split_bn",
    "shuffle_batch",
    "unshuffle",
]
