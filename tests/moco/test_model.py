"""MoCo forward: the paper's step, checked against recomputation from its parts."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipeline.moco.backbones import build_backbone, build_head
from pipeline.moco.batchnorm import SplitBatchNorm2d
from pipeline.moco.loss import info_nce
from pipeline.moco.model import MoCo
from pipeline.moco.queue import KeyQueue

N, K, D = 8, 24, 8


def _moco(bn="split", symmetric=False, m=0.99, seed=0):
    torch.manual_seed(seed)
    backbone = build_backbone("resnet18", width=4, in_channels=1, small_stem=True)
    head = build_head("mlp", backbone.num_features, 16, D)
    return MoCo(backbone, head, K=K, m=m, T=0.2, symmetric=symmetric, bn=bn, bn_splits=4).train()


def _images(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, 1, 16, 16, generator=g), torch.randn(N, 1, 16, 16, generator=g)


def _reference_queue(model, before, keys):
    ref = KeyQueue(D, K)
    ref.load_state_dict(before)
    ref.enqueue(keys, step=0)
    return ref.keys


def test_moco__key_encoder_is_exact_copy_of_query_encoder():
    model = _moco()
    q_state, k_state = model.encoder_q.state_dict(), model.encoder_k.state_dict()
    assert list(q_state) == list(k_state) and any(k.startswith("head.") for k in k_state)
    assert all(torch.equal(q_state[n], k_state[n]) for n in q_state)
    assert not any(p.requires_grad for p in model.encoder_k.parameters())
    ids = {id(p) for p in model.trainable_parameters()}
    assert ids == {id(p) for p in model.encoder_q.parameters()}
    assert not ids & {id(p) for p in model.encoder_k.parameters()}
    assert sum(isinstance(m, SplitBatchNorm2d) for m in model.encoder_k.modules()) == 20


def test_moco__forward_contrasts_against_queue_before_enqueue():
    model = _moco(bn="none")
    im_q, im_k = _images()
    before = {k: v.clone() for k, v in model.queue.state_dict().items()}
    out = model(im_q, im_k, step=0)
    assert out.logits.shape == (N, 1 + K) and out.q.shape == out.k.shape == (N, D)
    # keys: the (momentum-updated) key encoder on im_k, normalised; no shuffle with bn='none'
    with torch.no_grad():
        torch.testing.assert_close(out.k, F.normalize(model.encoder_k(im_k), dim=1))
    qd = out.q.detach()
    torch.testing.assert_close(out.logits[:, 0], (qd * out.k).sum(1) / 0.2)
    torch.testing.assert_close(out.logits[:, 1:], qd @ before["keys"] / 0.2)
    assert torch.equal(model.queue.keys, _reference_queue(model, before, out.k))
    assert int(model.queue.ptr) == N
    labels = torch.zeros(N, dtype=torch.long)
    torch.testing.assert_close(out.loss, F.cross_entropy(out.logits, labels))


def test_moco__momentum_update_once_per_forward():
    model = _moco(m=0.99)
    with torch.no_grad():
        for p in model.encoder_q.parameters():
            p.add_(0.5)
    old_k = [p.clone() for p in model.encoder_k.parameters()]
    model(*_images(), m=0.75)  # m overrides the default
    for pk, pq, old in zip(model.encoder_k.parameters(), model.encoder_q.parameters(), old_k):
        torch.testing.assert_close(pk, 0.75 * old + 0.25 * pq, rtol=1e-6, atol=1e-6)


def test_moco__gradient_reaches_only_the_query_encoder():
    model = _moco()
    out = model(*_images())
    out.loss.backward()  # after the in-place enqueue
    assert all(p.grad is not None for p in model.encoder_q.parameters())
    assert all(p.grad is None for p in model.encoder_k.parameters())


def test_moco__symmetric_one_enqueue_of_2n_keys_and_no_current_key_in_negatives():
    model = _moco(symmetric=True)
    im_q, im_k = _images()
    before = {k: v.clone() for k, v in model.queue.state_dict().items()}
    out = model(im_q, im_k, step=0)
    assert int(model.queue.ptr) == 2 * N and out.logits.shape == (2 * N, 1 + K)
    qd = out.q.detach()
    # both terms' negatives are q . queue_before: none of this batch's keys
    torch.testing.assert_close(out.logits[:, 1:], qd @ before["keys"] / 0.2)
    expected = (
        info_nce(qd[:N], out.k[:N], before["keys"], 0.2)[0]
        + info_nce(qd[N:], out.k[N:], before["keys"], 0.2)[0]
    )  # demo: sum of terms
    torch.testing.assert_close(out.loss.detach(), expected)
    assert torch.equal(model.queue.keys, _reference_queue(model, before, out.k))


def test_moco__split_bn_rejects_batch_not_divisible():
    model = _moco()
    with pytest.raises(ValueError, match="bn_splits"):
        model(torch.randn(6, 1, 16, 16), torch.randn(6, 1, 16, 16))


def test_moco__export_backbone_plain_keys_without_fc():
    model = _moco()
    model(*_images())
    state = model.export_backbone()
    target = build_backbone("resnet18", width=4, in_channels=1, small_stem=True)
    target.fc = nn.Linear(target.num_features, 10)
    result = target.load_state_dict(state, strict=False)
    assert sorted(result.missing_keys) == ["fc.bias", "fc.weight"] and not result.unexpected_keys
    assert torch.equal(state["bn1.running_mean"], model.encoder_q.backbone.bn1.running_mean)
    assert isinstance(model.encoder_q.backbone.bn1, SplitBatchNorm2d)  # model untouched


def test_moco__invalid_arguments_raise():
    backbone, head = nn.Identity(), nn.Linear(4, 2)
    with pytest.raises(ValueError, match="moco.bn"):
        MoCo(backbone, head, K=8, m=0.9, T=0.1, bn="ghost")
    with pytest.raises(ValueError, match="moco.m"):
        MoCo(backbone, head, K=8, m=1.1, T=0.1)
    with pytest.raises(ValueError, match="moco.T"):
        MoCo(backbone, head, K=8, m=0.9, T=0)
    with pytest.raises(ValueError, match="world_size is 1"):
        MoCo(backbone, head, K=8, m=0.9, T=0.1, bn="shuffle", world_size=1)
    MoCo(backbone, head, K=8, m=0.9, T=0.1, bn="shuffle", world_size=2)  # valid under DDP


def test_moco__small_crops_loss_is_the_mean_infonce_over_crops_by_a_slow_reference():
    # multi-crop: every query crop (the full one and 2 small ones) is contrasted with its image's
    # key and the PRE-step queue; the loss is the mean of the three InfoNCE terms. Reference:
    # each row's cross-entropy written out sample by sample with logsumexp.
    import copy

    model = _moco(bn="none", m=0.9)
    im_q, im_k = _images()
    g = torch.Generator().manual_seed(7)
    small = [torch.randn(N, 1, 8, 8, generator=g) for _ in range(2)]
    ref = copy.deepcopy(model)
    queue_before = model.queue.negatives().clone()  # (D, K)
    state_before = {k: v.clone() for k, v in model.queue.state_dict().items()}
    out = model(im_q, im_k, m=0.9, im_small=small)
    with torch.no_grad():
        for pk, pq in zip(ref.encoder_k.parameters(), ref.encoder_q.parameters()):
            pk.mul_(0.9).add_(pq, alpha=0.1)
        k = F.normalize(ref.encoder_k(im_k), dim=1)
        terms = []
        for x in [im_q, *small]:
            q = F.normalize(ref.encoder_q(x), dim=1)
            for i in range(N):
                logits = torch.cat([(q[i] @ k[i]).view(1), q[i] @ queue_before]) / 0.2
                terms.append(torch.logsumexp(logits, 0) - logits[0])
    assert out.loss.item() == pytest.approx(torch.stack(terms).mean().item(), rel=1e-4)
    # one enqueue of the N full-size keys: the queue advanced by N, small crops enqueue nothing
    assert int(model.queue.ptr) == (int(state_before["ptr"]) + N) % K
    assert torch.allclose(model.queue.keys, _reference_queue(model, state_before, k), atol=1e-5)
    # without small crops the loss is the plain InfoNCE (the division by 1 changes no bit)
    plain = _moco(bn="none", m=0.9)
    again = _moco(bn="none", m=0.9)
    a = plain(im_q, im_k, m=0.9)
    b = again(im_q, im_k, m=0.9, im_small=())
    assert torch.equal(a.loss, b.loss)


def test_moco__small_crops_refused_with_symmetric_or_another_batch():
    model = _moco(symmetric=True, bn="none")
    im_q, im_k = _images()
    with pytest.raises(ValueError, match="symmetric"):
        model(im_q, im_k, im_small=[im_q[:, :, :8, :8]])
    with pytest.raises(ValueError, match="same batch size"):
        _moco(bn="none")(im_q, im_k, im_small=[im_q[:4]])


def test_moco__default_bn_splits_is_the_params_default():
    # one default: MoCo(...) without bn_splits splits BN as params.yaml's moco.bn_splits does
    from pipeline.config import from_dict

    backbone = build_backbone("resnet18", width=4, in_channels=1, small_stem=True)
    net = MoCo(backbone, build_head("mlp", backbone.num_features, 16, D), K=K, m=0.9, T=0.2)
    splits = {m.num_splits for m in net.modules() if isinstance(m, SplitBatchNorm2d)}
    assert splits == {from_dict({}).moco.bn_splits} == {2}
