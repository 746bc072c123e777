"""KeyQueue against a slow one-key-at-a-time ring-buffer reference and a deque."""

import io
import math
from collections import deque

import pytest
import torch

from pipeline.moco.queue import KeyQueue


class SlowQueue:
    """Obviously-correct reference: write keys one at a time at ptr, then advance ptr."""

    def __init__(self, init: torch.Tensor):
        self.slots = [init[:, j].clone() for j in range(init.shape[1])]
        self.written = [-1] * init.shape[1]
        self.ptr = 0
        self.fifo = deque(maxlen=init.shape[1])

    def enqueue(self, keys, step):
        for row in keys:
            self.slots[self.ptr] = row.clone()
            self.written[self.ptr] = step
            self.ptr = (self.ptr + 1) % len(self.slots)
            self.fifo.append(row.clone())

    def keys(self):
        return torch.stack(self.slots, dim=1)


@pytest.mark.parametrize("batch", [1, 3, 4, 8, 11, 20])
def test_key_queue__fifo_matches_slow_reference(batch):
    D, K = 5, 8  # batch 4 and 8 divide K; 3 does not; 11 and 20 exceed K
    g = torch.Generator().manual_seed(0)
    queue = KeyQueue(D, K, generator=g)
    ref = SlowQueue(queue.keys.clone())
    storage = queue.keys.data_ptr()
    for step in range(max(3, math.ceil(3 * K / batch))):  # >= 3 * K keys: several wraps
        keys = torch.randn(batch, D, generator=g)
        queue.enqueue(keys, step)
        ref.enqueue(keys, step)
        assert torch.equal(queue.keys, ref.keys())
        assert int(queue.ptr) == ref.ptr
        assert queue.written_step.tolist() == ref.written
    # logical order, oldest first, equals the deque of the K most recent keys
    assert torch.equal(queue.keys.roll(-int(queue.ptr), dims=1), torch.stack(list(ref.fifo), 1))
    assert queue.keys.data_ptr() == storage  # written in place, never reallocated


def test_key_queue__batch_larger_than_k_keeps_last_k_in_order():
    queue = KeyQueue(1, 4)
    queue.enqueue(torch.arange(10.0).view(10, 1), step=0)
    # keys 0..9 written one by one at slots 0,1,2,3,0,1,...: slot j holds the last key with
    # index = j mod 4 -> [8, 9, 6, 7]; ptr = 10 mod 4 = 2 (points at the oldest, 6)
    assert queue.keys.tolist() == [[8.0, 9.0, 6.0, 7.0]]
    assert int(queue.ptr) == 2
    assert queue.keys.roll(-2, dims=1).tolist() == [[6.0, 7.0, 8.0, 9.0]]


def test_key_queue__initial_keys_are_unit_columns_and_never_written():
    queue = KeyQueue(16, 10)
    assert queue.keys.dtype == torch.float32 and queue.keys.shape == (16, 10)
    torch.testing.assert_close(queue.keys.norm(dim=0), torch.ones(10))
    assert queue.written_step.tolist() == [-1] * 10 and int(queue.ptr) == 0
    assert math.isnan(queue.mean_age(5)) and queue.filled() == 0.0


def test_key_queue__no_grad_and_fp32_storage():
    queue = KeyQueue(4, 6)
    keys = torch.randn(3, 4, requires_grad=True)
    queue.enqueue((keys * 2).to(torch.bfloat16), step=0)
    assert not queue.keys.requires_grad and queue.keys.grad_fn is None
    assert queue.keys.dtype == torch.float32
    assert torch.equal(queue.keys[:, :3], (keys * 2).detach().bfloat16().float().t())


def test_key_queue__negatives_snapshot_survives_enqueue_and_backward():
    queue = KeyQueue(4, 6)
    before = queue.keys.clone()
    q = torch.randn(2, 4, requires_grad=True)
    logits = q @ queue.negatives()
    queue.enqueue(torch.randn(3, 4), step=0)
    logits.sum().backward()  # would raise if the saved negatives had been modified in place
    torch.testing.assert_close(q.grad, before.sum(dim=1).expand(2, 4))


def test_key_queue__state_dict_round_trip_bit_for_bit():
    g = torch.Generator().manual_seed(1)
    queue = KeyQueue(6, 10, generator=g)
    for step in range(3):
        queue.enqueue(torch.randn(4, 6, generator=g), step)
    buf = io.BytesIO()
    torch.save(queue.state_dict(), buf)
    buf.seek(0)
    restored = KeyQueue(6, 10)  # different random init
    restored.load_state_dict(torch.load(buf))
    assert set(queue.state_dict()) == {"keys", "ptr", "written_step"}
    for name, value in queue.state_dict().items():
        assert torch.equal(restored.state_dict()[name], value), name
    nxt = torch.randn(7, 6, generator=g)
    queue.enqueue(nxt, 3)
    restored.enqueue(nxt, 3)
    assert torch.equal(restored.keys, queue.keys) and int(restored.ptr) == int(queue.ptr)


def test_key_queue__mean_age_by_hand():
    queue = KeyQueue(2, 4)
    queue.enqueue(torch.ones(2, 2), step=0)  # slots 0, 1 written at step 0
    assert queue.mean_age(3) == 3.0 and queue.filled() == 0.5  # only written slots count
    queue.enqueue(torch.ones(2, 2), step=1)  # slots 2, 3 at step 1
    assert queue.mean_age(3) == (3 + 3 + 2 + 2) / 4
    queue.enqueue(torch.ones(2, 2), step=5)  # wraps: slots 0, 1 at step 5
    assert queue.mean_age(5) == (0 + 0 + 4 + 4) / 4 and queue.filled() == 1.0


def test_key_queue__bad_shapes_raise():
    queue = KeyQueue(4, 6)
    with pytest.raises(ValueError, match=r"\(N, 4\)"):
        queue.enqueue(torch.randn(3, 5), step=0)
    with pytest.raises(ValueError, match="moco.K"):
        KeyQueue(4, 0)
