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
