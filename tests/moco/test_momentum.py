"""EMA update, key-encoder creation and momentum schedule, checked against hand arithmetic."""

import math

import pytest
import torch
from torch import nn

from pipeline.moco.momentum import make_key_encoder, momentum_schedule, momentum_update


def _net(seed):
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    net[1].running_mean.uniform_(-1, 1)  # buffers that must NOT be averaged
    net[1].running_var.uniform_(0.5, 2)
    return net


def test_momentum_update__one_step_is_m_old_plus_one_minus_m_q():
    q, k = _net(0), make_key_encoder(_net(0))
    k.load_state_dict(_net(1).state_dict())  # different starting point
    old = {n: p.clone() for n, p in k.named_parameters()}
    momentum_update(k, q, 0.9)
    for name, p in k.named_parameters():
        expected = 0.9 * old[name] + 0.1 * dict(q.named_parameters())[name].detach()
        torch.testing.assert_close(p, expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("m", [0.0, 1.0])
def test_momentum_update__m_one_freezes_m_zero_copies(m):
    q, k = _net(0), make_key_encoder(_net(1))
    old = {n: p.clone() for n, p in k.named_parameters()}
    momentum_update(k, q, m)
    for name, p in k.named_parameters():
        target = old[name] if m == 1.0 else dict(q.named_parameters())[name]
        assert torch.equal(p, target), name


def test_momentum_update__buffers_unchanged():
    q, k = _net(0), make_key_encoder(_net(1))
    buffers = {n: b.clone() for n, b in k.named_buffers()}
    momentum_update(k, q, 0.0)  # parameters copied, buffers must stay the key encoder's own
    for name, b in k.named_buffers():
        assert torch.equal(b, buffers[name]), name
    assert not torch.equal(k[1].running_mean, q[1].running_mean)


def test_momentum_update__no_grad_and_mismatch_raises():
    q, k = _net(0), make_key_encoder(_net(1))
    momentum_update(k, q, 0.5)
    assert all(p.grad_fn is None and not p.requires_grad for p in k.parameters())
    with pytest.raises(ValueError, match="different parameters"):
        momentum_update(nn.Linear(3, 5), nn.Linear(3, 4), 0.5)
    with pytest.raises(ValueError, match="moco.m"):
        momentum_update(k, q, 1.5)


def test_make_key_encoder__exact_copy_without_grad():
    q = _net(0)
    k = make_key_encoder(q)
    for (nq, tq), (nk, tk) in zip(q.state_dict().items(), k.state_dict().items()):
        assert nq == nk and torch.equal(tq, tk)
        assert tq.data_ptr() != tk.data_ptr()  # own storage
    assert all(p.requires_grad for p in q.parameters())
    assert not any(p.requires_grad for p in k.parameters())


def test_momentum_schedule__constant():
    assert momentum_schedule(0.99, 5) == [0.99] * 5


def test_momentum_schedule__cosine_by_hand():
    # T = 2: t=0 -> m; t=1 -> 1 - (1 - m)(cos(pi/2) + 1)/2 = 1 - (1 - m)/2
    torch.testing.assert_close(momentum_schedule(0.99, 2, "cosine"), [0.99, 0.995])
    T, m = 1000, 0.996
    s = momentum_schedule(m, T, "cosine")
    assert len(s) == T and s[0] == pytest.approx(m, abs=1e-12)
    assert s[T // 2] == pytest.approx(1 - (1 - m) / 2, abs=1e-12)  # cos(pi/2) = 0
    # last step t = T-1: 1 - (1-m)(1 - cos(pi/T))/2 ~ 1 - (1-m) pi^2 / (4 T^2)
    assert s[-1] == pytest.approx(1 - (1 - m) * math.pi**2 / (4 * T**2), abs=1e-12)
    assert all(a <= b for a, b in zip(s, s[1:])) and s[-1] < 1.0
    assert momentum_schedule(0.9, 1, "cosine") == [0.9]


def test_momentum_schedule__invalid_raises():
    with pytest.raises(ValueError, match="m_schedule"):
        momentum_schedule(0.9, 10, "linear")
    with pytest.raises(ValueError, match="total_steps"):
        momentum_schedule(0.9, 0)
    with pytest.raises(ValueError, match="base_m"):
        momentum_schedule(-0.1, 10)
