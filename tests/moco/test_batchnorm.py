"""SplitBatchNorm2d vs per-group plain BN, conversions, shuffling and BN-mode validation."""

import pytest
import torch
from torch import nn

from pipeline.moco.backbones import build_backbone
from pipeline.moco.batchnorm import (
    SplitBatchNorm2d,
    check_bn_mode,
    convert_split_bn,
    prepare_bn,
    revert_split_bn,
    shuffle_batch,
    unshuffle,
)


def _split_bn(C=3, S=4, seed=0):
    torch.manual_seed(seed)
    bn = SplitBatchNorm2d(C, S)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
    return bn


def test_split_bn__train_equals_plain_bn_per_group():
    S, x = 4, torch.randn(8, 3, 5, 5) * 2 + 1
    bn = _split_bn(S=S)
    y = bn.train()(x)
    for g in range(S):  # group g = samples g, g + S, ...
        plain = nn.BatchNorm2d(3).train()
        plain.load_state_dict({k: v for k, v in _split_bn(S=S).state_dict().items()})
        torch.testing.assert_close(y[g::S], plain(x[g::S]), rtol=1e-5, atol=1e-5)


def test_split_bn__running_stats_average_of_group_stats():
    S, x = 4, torch.randn(8, 3, 5, 5) * 2 + 1
    bn = _split_bn(S=S).train()
    bn(x)
    groups = [x[g::S] for g in range(S)]
    mean = torch.stack([grp.mean(dim=(0, 2, 3)) for grp in groups]).mean(0)
    var = torch.stack([grp.var(dim=(0, 2, 3), unbiased=True) for grp in groups]).mean(0)
    # momentum 0.1 from the initial running_mean = 0, running_var = 1
    torch.testing.assert_close(bn.running_mean, 0.1 * mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(bn.running_var, 0.9 + 0.1 * var, rtol=1e-5, atol=1e-6)
    assert int(bn.num_batches_tracked) == 1


@pytest.mark.parametrize(("momentum", "dtype", "tol"), [(0.1, torch.float32, 1e-5),
                                                     (None, torch.float32, 1e-5),
                                                     (0.1, torch.bfloat16, 2e-2)])
def test_split_bn__compiled_form_equals_eager_form(monkeypatch, momentum, dtype, tol):
    # Under torch.compile the layer normalises through _grouped_stats (var_mean over a split
    # batch) instead of F.batch_norm over merged groups; both run here eagerly, the compiled
    # form by making the layer believe it is being compiled. Two steps: the second starts from
    # running statistics the first moved (momentum None: the cumulative average).
    x = (torch.randn(8, 3, 5, 5) * 2 + 1).to(dtype)
    weights = torch.randn(8, 3, 5, 5)  # a loss that weighs each output differently

    def two_steps(compiling: bool) -> list[torch.Tensor]:
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: compiling)
        bn = _split_bn(S=4)
        bn.momentum = momentum
        xi = x.clone().requires_grad_()
        bn.train()(xi)
        y = bn(xi)
        (y.float() * weights).sum().backward()
        return [y, xi.grad, bn.weight.grad, bn.bias.grad, bn.running_mean, bn.running_var,
                bn.num_batches_tracked]

    eager, compiled = two_steps(False), two_steps(True)
    assert compiled[0].dtype == dtype
    for a, b in zip(eager, compiled, strict=True):
        torch.testing.assert_close(b, a, rtol=tol, atol=tol)


def test_split_bn__eval_equals_plain_bn_with_averaged_stats():
    bn = _split_bn().train()
    bn(torch.randn(8, 3, 5, 5) + 3)
    plain = nn.BatchNorm2d(3)
    plain.load_state_dict(bn.state_dict())
    x = torch.randn(6, 3, 5, 5)  # any batch size in eval
    assert torch.equal(bn.eval()(x), plain.eval()(x))


def test_split_bn__indivisible_batch_raises_naming_bn_splits_and_batch():
    with pytest.raises(ValueError, match=r"batch of 6 images.*bn_splits.*= 4"):
        _split_bn(S=4).train()(torch.randn(6, 3, 5, 5))


def test_convert_and_revert_split_bn__every_bn_and_same_eval_outputs():
    net = build_backbone("resnet18", width=4, in_channels=1, small_stem=True)
    n_bn = sum(isinstance(m, nn.BatchNorm2d) for m in net.modules())
    net = convert_split_bn(net, 2)
    assert sum(type(m) is SplitBatchNorm2d for m in net.modules()) == n_bn == 20
    net.train()(torch.randn(4, 1, 16, 16))  # move the running stats away from init
    x = torch.randn(3, 1, 16, 16)
    keys = list(net.state_dict())
    y_split = net.eval()(x)
    net = revert_split_bn(net)
    assert sum(type(m) is nn.BatchNorm2d for m in net.modules()) == n_bn
    assert not any(isinstance(m, SplitBatchNorm2d) for m in net.modules())
    assert list(net.state_dict()) == keys and not net.training
    assert torch.equal(net(x), y_split)


def test_prepare_bn__sync_and_none():
    net = prepare_bn(nn.Sequential(nn.Conv2d(1, 2, 1), nn.BatchNorm2d(2)), "sync")
    assert isinstance(net[1], nn.SyncBatchNorm)
    assert type(revert_split_bn(net)[1]) is nn.BatchNorm2d
    plain = nn.Sequential(nn.BatchNorm2d(2))
    assert type(prepare_bn(plain, "none")[0]) is nn.BatchNorm2d
    with pytest.raises(ValueError, match="moco.bn"):
        prepare_bn(plain, "group")


def test_shuffle_batch__unshuffle_is_identity():
    x = torch.arange(30.0).view(10, 3)
    xs, idx_unshuffle = shuffle_batch(x, generator=torch.Generator().manual_seed(0))
    assert sorted(xs[:, 0].tolist()) == x[:, 0].tolist()  # a permutation of the rows
    assert not torch.equal(xs, x)  # seed 0 does not give the identity for 10 rows
    assert torch.equal(unshuffle(xs, idx_unshuffle), x)


@pytest.mark.parametrize("S, changes", [(1, False), (2, True)])
def test_split_bn__shuffle_changes_keys_only_with_several_splits(S, changes):
    torch.manual_seed(0)
    enc = nn.Sequential(nn.Conv2d(2, 4, 3), SplitBatchNorm2d(4, S), nn.Flatten()).train()
    x = torch.randn(8, 2, 6, 6)
    # S=2 groups are samples {0,2,4,6} and {1,3,5,7}; after this permutation {0,1,2,3}, {4,5,6,7}
    perm = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7])
    direct = enc(x)
    through_perm = unshuffle(enc(x[perm]), torch.argsort(perm))
    diff = (direct - through_perm).abs().max().item()
    assert (diff > 1e-2) if changes else (diff < 1e-5)


@pytest.mark.parametrize(
    "bn, batch, splits, world, ok",
    [
        ("split", 64, 8, 1, True),
        ("split", 60, 8, 1, False),
        ("split", 64, 8, 4, True),
        ("shuffle", 64, 8, 1, False),
        ("shuffle", 64, 8, 2, True),
        ("sync", 64, 8, 1, False),
        ("sync", 64, 8, 2, True),
        ("none", 7, 8, 1, True),
        ("split", None, 8, 1, True),  # batch not known yet: only the world is checked
        ("shuffle", None, 8, 1, False),
        ("group", 64, 8, 1, False),
    ],
)
def test_check_bn_mode__valid_and_invalid_combinations(bn, batch, splits, world, ok):
    if ok:
        check_bn_mode(bn, batch, splits, world)
    else:
        with pytest.raises(ValueError, match="moco.bn"):
            check_bn_mode(bn, batch, splits, world)
