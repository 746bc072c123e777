"""A dead DataLoader worker, from PyTorch's RuntimeError text to one named failure."""

import signal
from types import SimpleNamespace

import pytest
from helpers import says

from pipeline.data.workers import LoaderWorkerError, worker_death

OOM = ("DataLoader worker (pid 4242) was killed by SIGKILL, as the out-of-memory killer does "
       "(see `dmesg` or the cgroup's memory.events; fewer loader workers, a smaller batch or "
       "smaller images need less memory)")


def test_worker_death__sigchld_text_killed__sigkill_looks_like_oom():
    # PyTorch's C++ text: strsignal(SIGKILL) = "Killed"
    died = worker_death(RuntimeError("DataLoader worker (pid 4242) is killed by signal: Killed. "))
    assert (died.pid, died.signum) == (4242, signal.SIGKILL)
    assert str(died) == OOM
    assert str(died.with_where("checkpoint written at step 6")) == OOM + "; checkpoint written " \
        "at step 6"


def test_worker_death__segfault_and_sigterm__not_the_oom_killer():
    segv = worker_death(RuntimeError("DataLoader worker (pid 7) is killed by signal: "
                                     "Segmentation fault. "))
    assert str(segv) == ("DataLoader worker (pid 7) was killed by SIGSEGV (not the "
                         "out-of-memory killer, which sends SIGKILL)")
    term = worker_death(RuntimeError("DataLoader worker (pid 8) is killed by signal: "
                                     "Terminated. "))
    assert term.signum == signal.SIGTERM and term.signal_name == "SIGTERM"


def test_worker_death__exited_unexpectedly__signal_from_the_workers_exit_code():
    err = RuntimeError("DataLoader worker (pid(s) 11, 12) exited unexpectedly")
    err.__cause__ = TimeoutError()
    workers = [SimpleNamespace(pid=11, exitcode=None), SimpleNamespace(pid=12, exitcode=-9)]
    died = worker_death(err, workers)
    assert (died.pid, died.signum) == (12, signal.SIGKILL)
    assert str(worker_death(err)) == "DataLoader worker (pid 11) exited unexpectedly"
    code = worker_death(RuntimeError("DataLoader worker (pid 5) exited unexpectedly with exit "
                                     "code 1. Details are lost due to multiprocessing."))
    assert str(code) == "DataLoader worker (pid 5) exited unexpectedly with exit code 1"


def test_worker_death__chained_and_unrelated():
    outer = RuntimeError("wrapper")
    outer.__context__ = RuntimeError("DataLoader worker (pid 9) is killed by signal: Killed. ")
    assert worker_death(outer).pid == 9
    assert worker_death(RuntimeError("CUDA out of memory")) is None
    assert worker_death(ValueError("x")) is None
    e = LoaderWorkerError(1, signal.SIGKILL)
    assert worker_death(e) is e


_KILLED_WORKER = """
import os, signal, time
import torch
from torch.utils.data import DataLoader
from pipeline.data.workers import shut_down

class Slow(torch.utils.data.Dataset):
    def __len__(self):
        return 64
    def __getitem__(self, i):
        time.sleep(0.05)
        return i

batches = iter(DataLoader(Slow(), batch_size=2, num_workers=2))
next(batches)
os.kill(batches._workers[0].pid, signal.SIGTERM)  # one worker dies of a signal, one lives
try:
    time.sleep(1.0)
except RuntimeError:  # PyTorch's SIGCHLD handler may raise here: the stage reports it
    pass
shut_down(batches)
# both workers stopped now, and the iterator marked shut down: its __del__ does nothing
print("alive", sum(w.is_alive() for w in batches._workers), batches._shutdown, flush=True)
"""


def _assert_workers_stopped_quietly(script_text: str, tmp_path) -> None:
    """Run a script in a fresh interpreter: it prints "alive 0 True" (no worker left, the
    iterator marked shut down) and Python prints no traceback, not even an ignored one."""
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "killed.py"
    script.write_text(script_text)
    root = str(Path(__file__).resolve().parents[2])
    r = subprocess.run([sys.executable, str(script)], capture_output=True,
                       text=True, timeout=120, cwd=root, env={"PYTHONPATH": root,
                                                              "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "alive 0 True"
    assert "Traceback" not in r.stderr and "Exception ignored" not in r.stderr, r.stderr[-2000:]


def test_shut_down__one_worker_killed__both_stopped_no_traceback(tmp_path):
    _assert_workers_stopped_quietly(_KILLED_WORKER, tmp_path)


_KILLED_TRAIN_LOADER_WORKER = """
import os, signal, time
import torch
from torch.utils.data import IterableDataset
from pipeline.data.readers import SizedLoader
from pipeline.data.workers import shut_down

class Slow(IterableDataset):
    def __iter__(self):
        for i in range(64):
            time.sleep(0.05)
            yield torch.tensor([i])

batches = iter(SizedLoader(Slow(), 64, 1, False))  # train_loader's iter: a generator
next(batches)
inner = batches.gi_frame.f_locals["batches"]  # PyTorch's iterator, which it wraps
os.kill(inner._workers[0].pid, signal.SIGTERM)  # a signal to the process group reaches it
try:
    time.sleep(1.0)
except RuntimeError:  # PyTorch's SIGCHLD handler may raise here: the stage reports it
    pass
shut_down(batches)
print("alive", sum(w.is_alive() for w in inner._workers), inner._shutdown, flush=True)
del batches, inner  # nothing left for a __del__ to do
"""


def test_shut_down__train_loader_generator__wrapped_iterator_stopped_no_traceback(tmp_path):
    _assert_workers_stopped_quietly(_KILLED_TRAIN_LOADER_WORKER, tmp_path)


def test_shut_down__an_iterator_without_workers_is_left_alone():
    from pipeline.data.workers import shut_down

    batches = iter([1, 2, 3])
    shut_down(batches)
    assert next(batches) == 1


def test_worker_death__connection_lost_while_a_worker_hands_over__names_the_dead_worker():
    # a worker SIGKILLed while the main process unpickles its batch: the batch's shared memory
    # comes by file descriptor through the worker's socket, gone with it (ConnectionRefusedError)
    joined = []
    alive = SimpleNamespace(pid=11, exitcode=None, join=lambda timeout: joined.append(11))
    dead = SimpleNamespace(pid=12, exitcode=-signal.SIGKILL, join=lambda timeout: joined.append(12))
    died = worker_death(ConnectionRefusedError(111, "Connection refused"), [alive, dead])
    assert (died.pid, died.signum) == (12, signal.SIGKILL) and joined == [11, 12]
    assert str(died) == OOM.replace("4242", "12")
    # no worker gone: not a worker death (the stage shows the error as it is)
    assert worker_death(ConnectionRefusedError(111, "Connection refused"), [alive]) is None
    assert worker_death(FileNotFoundError(2, "x"), None) is None


# PyTorch 2.x's text when a tensor's shared memory file does not fit in /dev/shm, as the main
# process re-raises it from the worker (the loaders' queue sends it in the batch's place)
SHM_FULL = ("Caught RuntimeError in DataLoader worker process 1.\nOriginal Traceback (most "
            "recent call last):\n  File \"queues.py\", line 244, in _feed\nRuntimeError: unable "
            "to allocate shared memory(shm) for file </torch_4774_3710846093_0>: No space left "
            "on device (28)\n")
MiB = 2**20


def test_worker_death__batch_did_not_fit_in_dev_shm__names_dev_shm_and_the_worker():
    from pipeline.data.workers import SharedMemoryError

    workers = [SimpleNamespace(pid=11, exitcode=None), SimpleNamespace(pid=12, exitcode=None)]
    died = worker_death(RuntimeError(SHM_FULL), workers)
    assert isinstance(died, SharedMemoryError) and died.pid == 12  # worker process 1
    assert worker_death(RuntimeError(SHM_FULL)).pid is None  # the workers not at hand
    # PyTorch 1.x's text
    old = RuntimeError("unable to write to file </torch_18_1594147285>: No space left on device")
    assert isinstance(worker_death(old), SharedMemoryError)
    # a full disk elsewhere, or too many open files for shared memory: not /dev/shm being full
    assert worker_death(OSError(28, "No space left on device", "ckpt/last.pt.tmp")) is None
    assert worker_death(RuntimeError("unable to open shared memory object </torch_1_2> in "
                                     "read-write mode: Too many open files (24)")) is None


def test_shared_memory_error__names_dev_shm_its_size_and_what_to_do():
    from pipeline.data.workers import SharedMemoryError

    e = SharedMemoryError(12, space=(4096, 64 * MiB))
    says(str(e), "/dev/shm", "size 64.0 MiB, 4 KiB free now", "a batch of DataLoader worker "
         "(pid 12)", "--shm-size")
    assert "num_workers" not in str(e)  # a stage without the param: no advice to set it
    full = e.with_workers_key("pretrain.num_workers").with_where("checkpoint written at step 6")
    assert isinstance(full, SharedMemoryError) and full.space == e.space
    says(str(full), "--shm-size", "or set `pretrain.num_workers: 0`",
         "; checkpoint written at step 6")
    assert str(full).startswith(str(e))
    says(str(SharedMemoryError(None, space=(0, 128 * 1024), item="the queues")),
         "size 128 KiB, 0 KiB free now", "the queues of the DataLoader")


class _Unsendable:
    """An object whose pickling fails as a tensor's does when ``/dev/shm`` is full."""

    def __reduce__(self):
        raise RuntimeError(SHM_FULL.splitlines()[-1].split(": ", 1)[1])


def test_reporting_queue__a_batch_that_cannot_be_sent__its_error_comes_in_its_place():
    import queue

    from torch._utils import ExceptionWrapper

    from pipeline.data.readers import reporting_context

    q = reporting_context().Queue()
    q.put((7, _Unsendable()))  # what a worker puts: (index, batch)
    index, sent = q.get(timeout=60)
    assert index == 7 and isinstance(sent, ExceptionWrapper)
    with pytest.raises(RuntimeError, match=r"</torch_4774_3710846093_0>: No space left"):
        sent.reraise()
    q.put("not a batch")
    q.put(_Unsendable())  # not a batch: dropped, as Python's queue does (its traceback printed)
    q.put((8, "next"))
    assert q.get(timeout=60) == "not a batch" and q.get(timeout=60) == (8, "next")
    with pytest.raises(queue.Empty):
        q.get(timeout=0.2)
    q.close()
    q.join_thread()



def test_reporting_queue__a_batch_failing_after_close__dropped_without_a_traceback(monkeypatch):
    # A worker closes its queue as it exits (the loader stopped at an earlier batch's error);
    # the feeder thread still pickles the batches put before: one that does not fit in
    # /dev/shm has no one to report to (the put raised "Queue is closed" in CI).
    import threading

    from pipeline.data.readers import reporting_context

    raised: list[BaseException] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: raised.append(args.exc_value))
    q = reporting_context().Queue()
    q.put((9, _Unsendable()))
    q.close()  # before the feeder thread has sent it: the feeder runs on after close
    q.join_thread()
    assert raised == []
    q._on_queue_feeder_error(RuntimeError("No space left on device"), (10, None))  # no raise

_UNSENDABLE_BATCH = """
from torch.utils.data import IterableDataset
from pipeline.data.readers import SizedLoader

class _Unsendable:  # pickles as a tensor does when /dev/shm is full
    def __reduce__(self):
        raise RuntimeError("unable to allocate shared memory(shm) for file </torch_1_2_0>: "
                           "No space left on device (28)")

class Stream(IterableDataset):
    def __iter__(self):
        yield from (_Unsendable() for _ in range(8))

batches = iter(SizedLoader(Stream(), 8, 1, False))
try:
    next(batches)
except Exception as e:
    inner = batches.gi_frame  # None: the generator is closed, its workers shut down
    print(type(e).__name__, getattr(e, "pid", None) is not None, inner, flush=True)
import multiprocessing
print("alive", len(multiprocessing.active_children()), flush=True)
"""


def test_sized_loader__worker_batch_not_sendable__one_error_instead_of_waiting_forever(
        tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "unsendable.py"
    script.write_text(_UNSENDABLE_BATCH)
    root = str(Path(__file__).resolve().parents[2])
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                       timeout=60, cwd=root, env={"PYTHONPATH": root, "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["SharedMemoryError", "True", "None", "alive", "0"]
    assert "Traceback" not in r.stderr, r.stderr[-2000:]


_LOADER_IN_SMALL_SHM = """
import multiprocessing, sys
import numpy as np
import torch
from pipeline.data.eval_loader import eval_loader
from pipeline.data.loader import train_loader

def to_tensor(img):  # (1, H, W) float32: 4 bytes a pixel
    return torch.from_numpy(np.asarray(img, dtype=np.float32))[None]

which, shards = sys.argv[1], sys.argv[2]
if which == "train":
    loader = train_loader(shards + "/pretrain", batch_size=16, steps=2, epoch=0, seed=0,
                          num_workers=1)
else:
    loader = eval_loader(shards + "/test", transform=to_tensor, batch_size=16, num_workers=1)
try:
    for _ in loader:
        pass
except Exception as e:
    print(f"{type(e).__name__}: {e}", flush=True)
print("alive", len(multiprocessing.active_children()), flush=True)
"""


@pytest.fixture(scope="module")
def large_image_shards(tmp_path_factory):
    """Shards of 128 x 128 grey images: a batch of 16 is 256 KiB as uint8, 1 MiB as float."""
    from helpers import build_tiny_shards

    return build_tiny_shards(tmp_path_factory.mktemp("shards128"), n_pretrain=32, n_train=16,
                             n_test=32, size=128)


@pytest.mark.parametrize(("which", "size", "item"), [
    ("train", "128k", "a batch of DataLoader worker (pid "),  # the batch does not fit
    ("eval", "128k", "a batch of DataLoader worker (pid "),
    ("train", "8k", "the queues of the DataLoader"),  # nor do the queues' semaphores
])
def test_loaders__small_dev_shm__one_error_no_worker_left(which, size, item, tmp_path,
                                                          large_image_shards):
    import subprocess
    import sys
    from pathlib import Path

    from helpers import small_shm

    script = tmp_path / "small_shm.py"
    script.write_text(_LOADER_IN_SMALL_SHM)
    root = str(Path(__file__).resolve().parents[2])
    r = subprocess.run([*small_shm(size), sys.executable, str(script), which,
                        str(large_image_shards)], capture_output=True, text=True, timeout=60,
                       cwd=root, env={"PYTHONPATH": root, "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr[-2000:]
    message, alive = r.stdout.strip().splitlines()
    kib = int(size[:-1])
    says(message, f"SharedMemoryError: shared memory /dev/shm (size {kib} KiB,", item,
         "--shm-size")
    assert alive == "alive 0"
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
