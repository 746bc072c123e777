"""Two gloo processes on CPU: DDP shuffle BN, gathered keys, identical queues on every rank."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pipeline.moco.backbones import build_backbone, build_head
from pipeline.moco.distributed import (
    batch_shuffle_ddp,
    batch_unshuffle_ddp,
    concat_all_gather,
    rank,
    ranks_identical,
    world_size,
)
from pipeline.moco.model import MoCo
from pipeline.moco.queue import KeyQueue

WORLD, N, D, K = 2, 4, 4, 10


def _keys(r, step):
    return torch.randn(N, D, generator=torch.Generator().manual_seed(100 * step + r))


def _moco():
    torch.manual_seed(0)  # same initial weights and queue on every rank
    backbone = build_backbone("resnet18", width=4, in_channels=1, small_stem=True)
    head = build_head("linear", backbone.num_features, 0, D)
    moco = MoCo(backbone, head, K=K, m=0.9, T=0.2, bn="shuffle", world_size=WORLD)
    return moco.train()


def _worker(r, init_file, out_dir):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)  # two processes on a small shared CPU
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=r, world_size=WORLD)
    try:
        res = {"rank": rank(), "world": world_size()}
        # 1. shuffle / unshuffle across ranks (rank 0 draws the permutation: seeded here)
        torch.manual_seed(0)
        x = torch.arange(N * 3, dtype=torch.float32).view(N, 3) + 100 * r
        xs, idx_unshuffle = batch_shuffle_ddp(x)
        res.update(x=x, xs=xs, idx=idx_unshuffle, back=batch_unshuffle_ddp(xs, idx_unshuffle))
        # 2. queue fed with gathered keys (3 steps: 24 keys through a queue of 10)
        queue = KeyQueue(D, K, generator=torch.Generator().manual_seed(7))
        for step in range(3):
            queue.enqueue(concat_all_gather(_keys(r, step)), step)
        res["queue"] = queue.state_dict()
        # 2b. the queue comparison: equal queues, then rank 1's changed by one ulp or its pointer
        keys, ptr = queue.keys.clone(), queue.ptr.clone()
        if r == 1:
            keys[2, 3] = torch.nextafter(keys[2, 3], torch.tensor(2.0))
            ptr += 1
        res["compare"] = {"same": ranks_identical(queue.keys, queue.ptr),
                          "keys_differ": ranks_identical(keys, queue.ptr),
                          "ptr_differ": ranks_identical(queue.keys, ptr)}
        # 3. a full MoCo step with shuffle BN under DDP
        model = _moco()
        ddp = torch.nn.parallel.DistributedDataParallel(model, forward_sync_buffers=False)
        g = torch.Generator().manual_seed(10 + r)  # different images on each rank
        im_q, im_k = torch.randn(N, 1, 16, 16, generator=g), torch.randn(N, 1, 16, 16, generator=g)
        out = ddp(im_q, im_k, step=0)
        out.loss.backward()
        res.update(
            moco_queue=model.queue.state_dict(),
            moco_k=out.k,
            grad=next(model.encoder_q.parameters()).grad,
        )
        torch.save(res, os.path.join(out_dir, f"rank{r}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ddp")
    mp.spawn(_worker, args=(str(tmp / "init"), str(tmp)), nprocs=WORLD, join=True)
    return [torch.load(tmp / f"rank{r}.pt") for r in range(WORLD)]


@pytest.mark.slow
def test_batch_shuffle_ddp__unshuffle_is_identity_and_mixes_ranks(results):
    assert [res["rank"] for res in results] == [0, 1] and results[0]["world"] == 2
    assert torch.equal(results[0]["idx"], results[1]["idx"])  # one permutation for all ranks
    everything = torch.cat([res["x"] for res in results])  # (2N, 3): rank 0's rows, then 1's
    shuffled = torch.cat([res["xs"] for res in results])
    # rank r encodes rows idx_shuffle[r N:(r + 1) N] of the gathered batch, idx_shuffle being
    # the inverse of the returned idx_unshuffle
    idx_shuffle = torch.argsort(results[0]["idx"])
    assert torch.equal(shuffled, everything[idx_shuffle])
    # mixed: each rank encodes rows of the other rank (values >= 100 come from rank 1)
    assert (results[0]["xs"][:, 0] >= 100).any() and (results[1]["xs"][:, 0] < 100).any()
    for res in results:
        assert torch.equal(res["back"], res["x"])


@pytest.mark.slow
def test_concat_all_gather__queues_identical_and_equal_single_process(results):
    ref = KeyQueue(D, K, generator=torch.Generator().manual_seed(7))
    for step in range(3):
        ref.enqueue(torch.cat([_keys(r, step) for r in range(WORLD)]), step)  # rank order
    for res in results:
        for name, value in ref.state_dict().items():
            assert torch.equal(res["queue"][name], value), name


@pytest.mark.slow
def test_ranks_identical__sees_one_rank_differ_on_every_rank(results):
    # rank 1 changed one key by one ulp, or its pointer by one: every rank reports the mismatch
    assert [res["compare"] for res in results] == [
        {"same": True, "keys_differ": False, "ptr_differ": False}] * WORLD


def test_ranks_identical__one_process_has_nothing_to_compare():
    assert ranks_identical(torch.zeros(D, K), torch.tensor(3))


@pytest.mark.slow
def test_moco__ddp_shuffle_bn_queues_identical_on_all_ranks(results):
    q0, q1 = results[0]["moco_queue"], results[1]["moco_queue"]
    assert all(torch.equal(q0[name], q1[name]) for name in q0)
    ref = _moco().queue  # same seed: the initial queue of both ranks
    ref.enqueue(torch.cat([res["moco_k"] for res in results]), 0)
    assert torch.equal(q0["keys"], ref.keys) and int(q0["ptr"]) == 2 * N
    assert torch.equal(results[0]["grad"], results[1]["grad"])  # DDP averaged the gradients
