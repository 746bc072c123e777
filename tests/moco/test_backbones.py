"""Backbones equal torchvision's ResNets at width 64; width, stem, heads, export."""

import pytest
import torch
import torchvision
from torch import nn

from pipeline.moco.backbones import (
    build_backbone,
    build_head,
    export_state_dict,
    known_backbones,
    resolve_small_stem,
    resolve_stem_stride,
)
from pipeline.moco.batchnorm import convert_split_bn


def _shapes(model):
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


@pytest.mark.parametrize("name, features", [("resnet18", 512), ("resnet50", 2048)])
def test_build_backbone__width_64_equals_torchvision_keys_and_shapes(name, features):
    ours = build_backbone(name)
    assert ours.num_features == features and isinstance(ours.fc, nn.Identity)
    ours.fc = nn.Linear(ours.num_features, 1000)
    tv = getattr(torchvision.models, name)()
    assert list(_shapes(ours).items()) == list(_shapes(tv).items())  # same keys, order, shapes
    assert [n for n, _ in ours.named_children()] == [n for n, _ in tv.named_children()]


def test_build_backbone__same_function_as_torchvision_resnet18():
    ours = build_backbone("resnet18").eval()
    tv = torchvision.models.resnet18()
    tv.fc = nn.Identity()
    tv.load_state_dict(ours.state_dict())
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        assert torch.equal(ours(x), tv.eval()(x))


def test_build_backbone__width_scales_stages():
    r18 = build_backbone("resnet18", width=16)
    assert r18.num_features == 128  # 8 * 16
    assert [
        r18.layer1[0].conv1.out_channels,
        r18.layer2[0].conv1.out_channels,
        r18.layer3[0].conv1.out_channels,
        r18.layer4[0].conv1.out_channels,
    ] == [16, 32, 64, 128]
    r50 = build_backbone("resnet50", width=16)
    assert r50.num_features == 512  # 8 * 16 * expansion 4
    assert r50.layer1[0].conv2.out_channels == 16 and r50.layer4[-1].conv3.out_channels == 512


def test_build_backbone__small_stem_grey_28px():
    net = build_backbone("resnet18", width=8, in_channels=1, small_stem=True)
    assert net.conv1.kernel_size == (3, 3) and net.conv1.stride == (1, 1)
    assert net.conv1.in_channels == 1 and isinstance(net.maxpool, nn.Identity)
    seen = {}

    def hook(module, inputs, output):
        seen["l4"] = output.shape

    net.layer4.register_forward_hook(hook)
    out = net(torch.randn(2, 1, 28, 28))
    assert out.shape == (2, 64)  # 8 * width
    assert seen["l4"] == (2, 64, 4, 4)  # 28 -> 28 -> 14 -> 7 -> 4 (3x3 stride-2, padding 1)


def test_build_backbone__stem_stride_2_halves_the_side_before_layer1():
    net = build_backbone("resnet18", width=8, in_channels=1, small_stem=True, stem_stride=2)
    assert net.conv1.kernel_size == (3, 3) and net.conv1.stride == (2, 2)
    seen = {}

    def hook(name):
        def record(module, inputs, output):
            seen[name] = output.shape
        return record

    net.layer1.register_forward_hook(hook("l1"))
    net.layer4.register_forward_hook(hook("l4"))
    out = net(torch.randn(2, 1, 28, 28))
    assert out.shape == (2, 64)
    # 28 -> 14 (stem: floor((28 + 2 - 3) / 2) + 1) -> 14 -> 7 -> 4 -> 2
    assert seen["l1"] == (2, 8, 14, 14) and seen["l4"] == (2, 64, 2, 2)
    # the stride-1 net has the same parameters: only the stem's stride differs
    ref = build_backbone("resnet18", width=8, in_channels=1, small_stem=True)
    assert _shapes(ref) == _shapes(net)


def test_resolve_stem_stride__only_the_small_stem_takes_it():
    assert resolve_stem_stride(2, True) == 2 and resolve_stem_stride(1, True) == 1
    assert resolve_stem_stride(2, False) == 1  # the ImageNet stem keeps its own stride


def test_build_backbone__stem_stride_errors():
    with pytest.raises(ValueError, match="model.stem_stride must be 1 or 2, got 3"):
        build_backbone("resnet18", width=8, small_stem=True, stem_stride=3)
    with pytest.raises(ValueError, match="needs the small 3x3 stem"):
        build_backbone("resnet18", width=8, small_stem=False, stem_stride=2)


def test_build_backbone__unknown_name_lists_known():
    with pytest.raises(ValueError, match="resnet18, resnet34, resnet50"):
        build_backbone("vit_b16")
    assert known_backbones() == ("resnet18", "resnet34", "resnet50")


def test_export_state_dict__loads_with_only_fc_missing():
    net = convert_split_bn(build_backbone("resnet34", width=4, in_channels=1, small_stem=True), 4)
    state = export_state_dict(net)
    assert not any(k.startswith("fc.") for k in state)
    assert all(v.device.type == "cpu" and not v.requires_grad for v in state.values())
    target = build_backbone("resnet34", width=4, in_channels=1, small_stem=True)
    target.fc = nn.Linear(target.num_features, 10)
    result = target.load_state_dict(state, strict=False)
    assert sorted(result.missing_keys) == ["fc.bias", "fc.weight"]
    assert result.unexpected_keys == []
    assert torch.equal(target.layer1[0].bn1.running_var, net.layer1[0].bn1.running_var)


def test_build_head__linear_and_mlp():
    linear = build_head("linear", 512, 999, 128)
    assert [type(m) for m in linear] == [nn.Linear]
    assert linear[0].weight.shape == (128, 512)
    mlp = build_head("mlp", 512, 2048, 128)
    assert [type(m) for m in mlp] == [nn.Linear, nn.ReLU, nn.Linear]
    assert mlp[0].weight.shape == (2048, 512) and mlp[2].weight.shape == (128, 2048)
    assert mlp(torch.randn(3, 512)).shape == (3, 128)
    with pytest.raises(ValueError, match="model.head"):
        build_head("transformer", 512, 2048, 128)


def test_resolve_small_stem__auto_below_64px():
    assert resolve_small_stem("auto", 28) and resolve_small_stem("auto", 32)
    assert not resolve_small_stem("auto", 64) and not resolve_small_stem("auto", 224)
    assert resolve_small_stem("true", 224) and not resolve_small_stem("false", 28)
    with pytest.raises(ValueError, match="model.small_stem"):
        resolve_small_stem("yes", 28)
