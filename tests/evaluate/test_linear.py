import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipeline.evaluate.features import FeatureSet
from pipeline.evaluate.heldout import split_train_val
from pipeline.evaluate.linear import train_linear_augment, train_linear_on_features
from pipeline.schedules import lr_schedule


def lr_per_epoch(*, lr, batch_size, epochs, lr_schedule: str, milestones):
    """The probe's per-epoch lrs: the one schedule, one step per epoch (as the probe asks)."""
    return lr_schedule_fn(base_lr=lr, batch_size=batch_size, total_steps=epochs,
                          steps_per_epoch=1, schedule=lr_schedule, milestones=milestones)


lr_schedule_fn = lr_schedule


def _blobs(seed, n, sep, d=8, c=3, label_noise=0.0, prefix="k"):
    """Gaussian blobs: class c at sep * e_c, unit isotropic noise."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, c, (n,), generator=g)
    x = sep * torch.eye(d)[y] + torch.randn(n, d, generator=g)
    if label_noise:
        flip = torch.rand(n, generator=g) < label_noise
        y = torch.where(flip, torch.randint(0, c, (n,), generator=g), y)
    return FeatureSet(x, y, [f"{prefix}{i}" for i in range(n)])


def _final_model_top1(result, test):
    """Accuracy of the returned classifier recomputed from its weights (l2 feature norm)."""
    w, b = result.classifier_state["weight"], result.classifier_state["bias"]
    logits = F.normalize(test.features, dim=1) @ w.T + b
    pred = torch.tensor(result.classes)[logits.argmax(1)]
    return 100.0 * (pred == test.labels).double().mean().item(), pred


def test_train_linear_on_features__separable_blobs_above_95():
    # Means 4 e_c: pairwise distance 4 sqrt(2), so a pairwise error is Phi(-2 sqrt 2) = 0.23 %
    # and the Bayes rule argmax_c x_c (scale-invariant, so unchanged by the L2 norm) is ~99.5 %.
    train, test = _blobs(0, 300, 4.0), _blobs(1, 300, 4.0, prefix="t")
    r = train_linear_on_features(train, test, epochs=10, batch_size=32, milestones=(6, 8))
    assert r.top1 > 95.0
    assert r.top5_k == 3 and r.top5 == 100.0
    assert r.confusion.sum() == 300 and r.confusion.shape == (3, 3)
    assert len(r.history) == 10


def test_train_linear_on_features__reports_final_epoch_not_best():
    # 30 % label noise, overlapping blobs and a constant, huge lr: test accuracy jumps around
    # (an earlier epoch reaches 57.5 %, the final one 35.5 %); the result must be the final one.
    train, test = _blobs(0, 200, 1.0, label_noise=0.3), _blobs(100, 200, 1.0, prefix="t")
    r = train_linear_on_features(train, test, epochs=8, batch_size=16, milestones=(100,))
    per_epoch = [h["test_top1"] for h in r.history]
    assert max(per_epoch) >= r.top1 + 10.0  # the case is meaningful: an earlier epoch was better
    assert r.top1 == per_epoch[-1]
    top1, pred = _final_model_top1(r, test)
    assert r.top1 == pytest.approx(top1)
    assert torch.equal(r.predictions, pred)


def test_train_linear_on_features__without_test_curve_same_classifier_and_top1():
    # Scoring the test set after each epoch draws no random numbers: the weights, and so the
    # final top-1, are the same bits without the per-epoch curve.
    train, test = _blobs(0, 200, 1.0, label_noise=0.3), _blobs(100, 200, 1.0, prefix="t")
    kw = {"epochs": 8, "batch_size": 16, "milestones": (5,), "seed": 3}
    a = train_linear_on_features(train, test, **kw)
    b = train_linear_on_features(train, test, test_curve=False, **kw)
    for k in ("weight", "bias"):
        assert torch.equal(a.classifier_state[k], b.classifier_state[k]), k
    assert a.top1 == b.top1 and torch.equal(a.predictions, b.predictions)
    assert "test_top1" in a.history[-1] and all("test_top1" not in h for h in b.history)


def test_lr_per_epoch__step_and_cosine_by_hand():
    # lr 30 per 256 at batch 64 -> 7.5; x0.1 from (0-based) epoch 2 and again from epoch 4
    got = lr_per_epoch(lr=30.0, batch_size=64, epochs=5, lr_schedule="step", milestones=[2, 4])
    assert got == pytest.approx([7.5, 7.5, 0.75, 0.75, 0.075])
    # cosine over 4 epochs: 0.5 (1 + cos(pi e / 4)) = 1, 0.853553, 0.5, 0.146447
    got = lr_per_epoch(lr=30.0, batch_size=512, epochs=4, lr_schedule="cosine", milestones=[])
    assert got == pytest.approx([60.0, 51.21320, 30.0, 8.78680], abs=1e-4)
    with pytest.raises(ValueError, match="lr_schedule"):
        lr_per_epoch(lr=1.0, batch_size=1, epochs=1, lr_schedule="linear", milestones=[])


def test_train_linear_on_features__lr_scaling_in_history():
    train, test = _blobs(0, 64, 4.0), _blobs(1, 32, 4.0, prefix="t")
    r = train_linear_on_features(train, test, epochs=3, batch_size=64, lr=30.0, milestones=(2,))
    assert [h["lr"] for h in r.history] == pytest.approx([7.5, 7.5, 0.75])
    assert r.lr_effective == pytest.approx(7.5)
    assert [h["epoch"] for h in r.history] == [1, 2, 3]


def test_split_train_val__disjoint_and_deterministic():
    tr, val = split_train_val(100, 0.2, seed=3)
    assert len(val) == 20 and len(tr) == 80
    assert sorted(tr.tolist() + val.tolist()) == list(range(100))
    again = split_train_val(100, 0.2, seed=3)
    assert torch.equal(again[0], tr) and torch.equal(again[1], val)
    assert not torch.equal(split_train_val(100, 0.2, seed=4)[1], val)
    assert len(split_train_val(10, 0.0, seed=0)[1]) == 0
    assert len(split_train_val(10, 0.01, seed=0)[1]) == 1  # at least one when asked for
    with pytest.raises(ValueError, match="val_fraction"):
        split_train_val(10, 1.0, seed=0)


def test_train_linear_on_features__val_split_from_train_only():
    train, test = _blobs(0, 100, 4.0, prefix="train"), _blobs(1, 50, 4.0, prefix="test")
    r = train_linear_on_features(train, test, epochs=2, batch_size=16, val_fraction=0.2, seed=5)
    _, val_idx = split_train_val(100, 0.2, seed=5)
    assert r.val_keys == [f"train{i}" for i in val_idx.tolist()]
    assert set(r.val_keys).isdisjoint(test.keys)
    assert r.val_top1 is not None and r.val_top1 == r.history[-1]["val_top1"]
    assert "val_top1" in r.metrics() and "val_top1" not in train_linear_on_features(
        train, test, epochs=1, batch_size=16).metrics()


def test_train_linear_on_features__deterministic_given_seed():
    train, test = _blobs(0, 120, 1.0), _blobs(1, 60, 1.0, prefix="t")
    kw = dict(epochs=3, batch_size=16, milestones=(2,))
    a = train_linear_on_features(train, test, seed=7, **kw)
    b = train_linear_on_features(train, test, seed=7, **kw)
    c = train_linear_on_features(train, test, seed=8, **kw)
    assert a.history == b.history
    assert torch.equal(a.classifier_state["weight"], b.classifier_state["weight"])
    assert not torch.equal(a.classifier_state["weight"], c.classifier_state["weight"])


def _reference_probe(train, *, epochs, batch_size, lr, milestones, seed, l2):
    """The MoCo probe written plainly: each batch normalised as it is drawn, SGD 0.9, x0.1 steps."""
    clf = nn.Linear(train.features.shape[1], int(train.labels.max()) + 1)
    with torch.no_grad():
        clf.weight.normal_(0.0, 0.01, generator=torch.Generator().manual_seed(seed))
        clf.bias.zero_()
    opt = torch.optim.SGD(clf.parameters(), lr=lr, momentum=0.9)
    order = torch.Generator().manual_seed(seed)
    for epoch in range(epochs):
        for group in opt.param_groups:
            group["lr"] = lr * batch_size / 256 * 0.1 ** sum(epoch >= m for m in milestones)
        perm = torch.randperm(len(train), generator=order)
        for i in range(0, len(perm), batch_size):
            x = train.features[perm[i:i + batch_size]]
            x = F.normalize(x, dim=1) if l2 else x
            loss = F.cross_entropy(clf(x), train.labels[perm[i:i + batch_size]])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return clf


@pytest.mark.parametrize("feature_norm", ["l2", "none"])
def test_train_linear_on_features__equals_a_probe_normalising_every_batch(feature_norm):
    # the probe normalises each fixed feature row once; the reference does it per batch, as
    # drawn, every epoch: the classifiers must agree
    train, test = _blobs(0, 150, 1.5, d=16), _blobs(1, 40, 1.5, d=16, prefix="t")
    kw = dict(epochs=5, batch_size=32, lr=3.0, milestones=(3, 4), seed=4)
    r = train_linear_on_features(train, test, feature_norm=feature_norm, **kw)
    ref = _reference_probe(train, l2=feature_norm == "l2", **kw)
    assert torch.allclose(r.classifier_state["weight"], ref.weight.detach(), atol=1e-5)
    assert torch.allclose(r.classifier_state["bias"], ref.bias.detach(), atol=1e-5)


def test_train_linear_on_features__non_contiguous_labels():
    train, test = _blobs(0, 150, 4.0), _blobs(1, 60, 4.0, prefix="t")
    values = torch.tensor([3, 7, 42])
    relab = lambda fs: FeatureSet(fs.features, values[fs.labels], fs.keys)  # noqa: E731
    a = train_linear_on_features(train, test, epochs=2, batch_size=16)
    b = train_linear_on_features(relab(train), relab(test), epochs=2, batch_size=16)
    assert (a.top1, a.top5) == (b.top1, b.top5)
    assert b.classes == [3, 7, 42] and torch.equal(b.predictions, values[a.predictions])


def test_train_linear_on_features__non_finite_loss_raises():
    train, test = _blobs(0, 32, 4.0), _blobs(1, 8, 4.0, prefix="t")
    train.features[5, 0] = float("nan")
    with pytest.raises(FloatingPointError, match="non-finite loss"):
        train_linear_on_features(train, test, epochs=1, batch_size=8)


class _TinyBackbone(nn.Module):
    """Conv + BN + ReLU + global average pool: (B, 3, 8, 8) -> (B, 4)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return F.relu(self.bn(self.conv(x))).mean(dim=(2, 3))  # B x 4


def _image_batches(seed, n_batches, b=8):
    """Two classes: class 1 images are brighter (+1) in channel 0."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_batches):
        y = torch.randint(0, 2, (b,), generator=g)
        x = torch.randn(b, 3, 8, 8, generator=g)
        x[:, 0] += y[:, None, None].float()
        out.append((x, y))
    return out


def _snapshot(module):
    tensors = dict(module.named_parameters()) | dict(module.named_buffers())
    return {k: v.detach().clone() for k, v in tensors.items()}


def test_train_linear_augment__backbone_bit_identical_and_mode_restored():
    torch.manual_seed(0)
    backbone = _TinyBackbone()
    backbone.train()  # a probe that forgot eval() would update BN running stats and fail below
    before = _snapshot(backbone)
    train = {e: _image_batches(e, 3) for e in range(3)}
    test = _image_batches(99, 2)
    r = train_linear_augment(
        backbone, lambda e: train[e], test, num_features=4, num_classes=2, batch_size=8,
        epochs=3, milestones=(2,),
    )
    after = _snapshot(backbone)
    assert before.keys() == after.keys()
    for k in before:
        assert torch.equal(before[k], after[k]), k
    assert backbone.training and backbone.bn.training
    assert backbone.calls == 3 * 3 + 2  # every training step and test batch went through it
    assert [h["lr"] for h in r.history] == pytest.approx([0.9375, 0.9375, 0.09375])  # 30 * 8/256
    assert r.top1 == r.history[-1]["test_top1"] and r.confusion.sum() == 16


class _LeakyBackbone(_TinyBackbone):
    def forward(self, x):
        with torch.no_grad():
            self.bn.running_mean.add_(1e-3)  # a buffer change that eval mode cannot prevent
        return super().forward(x)


def test_train_linear_augment__raises_if_a_buffer_changes():
    backbone = _LeakyBackbone().eval()
    with pytest.raises(RuntimeError, match=r"buffer bn\.running_mean"):
        train_linear_augment(
            backbone, lambda e: _image_batches(e, 1), _image_batches(9, 1), num_features=4,
            num_classes=2, batch_size=8, epochs=1,
        )
    assert not backbone.training


def test_train_linear_augment__labels_out_of_range_raise():
    with pytest.raises(ValueError, match=r"linear: train batch labels: label 2 at row 1 .*0\.\.1"):
        train_linear_augment(
            _TinyBackbone(), lambda e: [(torch.zeros(2, 3, 8, 8), torch.tensor([0, 2]))],
            [], num_features=4, num_classes=2, batch_size=2, epochs=1,
        )
    with pytest.raises(ValueError, match=r"linear: test batch labels: label -3 at row 0"):
        train_linear_augment(
            _TinyBackbone(), lambda e: [(torch.zeros(2, 3, 8, 8), torch.tensor([0, 1]))],
            [(torch.zeros(1, 3, 8, 8), torch.tensor([-3]))], num_features=4, num_classes=2,
            batch_size=2, epochs=1,
        )


def _with_unlabelled(batches, seed):
    """The same batches with 3 extra rows labelled -1 (random images) inserted in each."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for x, y in batches:
        pos = torch.tensor([0, len(y) // 2, len(y) + 2])  # start, middle, end of the new batch
        keep = torch.ones(len(y) + 3, dtype=torch.bool)
        keep[pos] = False
        xx = torch.randn(len(y) + 3, *x.shape[1:], generator=g)
        yy = torch.full((len(y) + 3,), -1)
        xx[keep], yy[keep] = x, y
        out.append((xx, yy))
    return out


def test_train_linear_augment__unlabelled_rows_ignored(caplog):
    train = {e: _image_batches(e, 3) for e in range(2)}
    test = _image_batches(99, 2)
    kw = dict(num_features=4, num_classes=2, batch_size=8, epochs=2, milestones=(1,))
    torch.manual_seed(0)
    a = train_linear_augment(_TinyBackbone(), lambda e: train[e], test, **kw)
    noisy = {e: _with_unlabelled(b, e) for e, b in train.items()}
    noisy[0].append((torch.randn(2, 3, 8, 8), torch.tensor([-1, -1])))  # all unlabelled: skipped
    torch.manual_seed(0)
    with caplog.at_level("WARNING", logger="pipeline.evaluate.linear"):
        b = train_linear_augment(_TinyBackbone(), lambda e: noisy[e], _with_unlabelled(test, 9),
                                 **kw)
    assert a.history == b.history
    assert torch.equal(a.predictions, b.predictions) and len(b.predictions) == 16
    assert torch.equal(a.classifier_state["weight"], b.classifier_state["weight"])
    # 3 per batch: 2 epochs x 3 batches x 3 + the all-unlabelled batch's 2; test 2 x 3
    assert "20 train (all 2 epochs), 0 validation (all epochs), 6 test" in caplog.text


def _insert_unlabelled(fs, where, seed):
    """``fs`` with rows labelled -1 inserted before the rows ``where`` (random features)."""
    g = torch.Generator().manual_seed(seed)
    rows, labels, keys = [], [], []
    for i in range(len(fs)):
        if i in where:
            rows.append(torch.randn(fs.features.shape[1], generator=g) * 5)
            labels.append(-1)
            keys.append(f"u{i}")
        rows.append(fs.features[i])
        labels.append(int(fs.labels[i]))
        keys.append(fs.keys[i])
    return FeatureSet(torch.stack(rows), torch.tensor(labels), keys)


def test_train_linear_on_features__unlabelled_rows_ignored(caplog):
    train, test = _blobs(0, 120, 2.0), _blobs(1, 40, 2.0, prefix="t")
    kw = dict(epochs=3, batch_size=16, milestones=(2,), val_fraction=0.25, seed=4)
    a = train_linear_on_features(train, test, **kw)
    with caplog.at_level("WARNING", logger="pipeline.evaluate.metrics"):
        b = train_linear_on_features(_insert_unlabelled(train, {0, 5, 119}, 1),
                                     _insert_unlabelled(test, {3, 39}, 2), **kw)
    assert a.history == b.history and a.val_keys == b.val_keys
    assert (a.top1, a.top5, a.classes) == (b.top1, b.top5, b.classes) and -1 not in b.classes
    assert torch.equal(a.predictions, b.predictions) and len(b.predictions) == 40
    assert "linear: train labels: ignoring 3 of 123 rows labelled -1" in caplog.text
    assert "linear: test labels: ignoring 2 of 42 rows labelled -1" in caplog.text


def test_train_linear_on_features__labels_out_of_range_are_named():
    train, test = _blobs(0, 30, 2.0), _blobs(1, 10, 2.0, prefix="t")
    with pytest.raises(ValueError, match=r"linear: train labels: label 2 at row \d+ .*0\.\.1"):
        train_linear_on_features(train, test, epochs=1, batch_size=8, num_classes=2)
    labels = test.labels.clone()
    labels[4] = -2
    bad = FeatureSet(test.features, labels, test.keys)
    with pytest.raises(ValueError, match=r"linear: test labels: label -2 at row 4"):
        train_linear_on_features(train, bad, epochs=1, batch_size=8)
    with pytest.raises(ValueError, match="must not be empty"):
        unl = FeatureSet(train.features, torch.full((30,), -1), train.keys)
        train_linear_on_features(unl, test, epochs=1, batch_size=8)


def test_lr_per_epoch__milestones_beyond_epochs_never_fire():
    got = lr_per_epoch(lr=30.0, batch_size=256, epochs=2, lr_schedule="step", milestones=[60, 80])
    assert got == [30.0, 30.0]
    assert math.isclose(lr_per_epoch(lr=0.5, batch_size=512, epochs=1, lr_schedule="cosine",
                                     milestones=[])[0], 1.0)


def test_train_linear_on_features__held_out_rows_leave_the_training_unchanged():
    # the probe trains on the rows split_train_val keeps, gathered batch by batch: the same
    # classifier, bit for bit, as a probe on a copy of exactly those rows without validation
    train, test = _blobs(2, 120, 3.0, prefix="train"), _blobs(3, 40, 3.0, prefix="test")
    r = train_linear_on_features(train, test, epochs=3, batch_size=16, val_fraction=0.25,
                                 seed=4)
    tr, _ = split_train_val(120, 0.25, seed=4)
    ref = train_linear_on_features(train.subset(tr), test, epochs=3, batch_size=16, seed=4)
    for name, value in ref.classifier_state.items():
        assert torch.equal(r.classifier_state[name], value), name
