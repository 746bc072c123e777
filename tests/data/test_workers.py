"""A dead DataLoader worker, from PyTorch's RuntimeError text to one named failure."""

import signal
from types import SimpleNamespace

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
