"""The stage entry's one ``error:`` line: failures we can name, bugs keep their traceback."""

import pytest

from pipeline.cli import error_line, rerun_hint, stage_main
from pipeline.data.shards import ShardError
from pipeline.errors import InputError


def _raise(exc):
    raise exc


def test_error_line__own_input_check__one_line():
    from pipeline.evaluate.heldout import split_train_val

    with pytest.raises(ValueError) as e:  # an InputError is a ValueError
        split_train_val(10, 1.5, seed=0)
    assert error_line(e.value) == "InputError: val_fraction = 1.5; allowed: 0 <= x < 1"


def test_error_line__by_type_not_by_where_it_was_raised():
    import torch

    with pytest.raises(RuntimeError) as e:
        torch.zeros(2) @ torch.zeros(3)  # raised inside torch: not ours to name
    assert error_line(e.value) is None
    assert error_line(AssertionError("bug")) is None
    assert error_line(KeyError("k")) is None
    # a plain ValueError is a bug wherever it comes from, our own code included
    with pytest.raises(ValueError) as e:
        int("x")
    assert error_line(e.value) is None
    assert error_line(InputError("a.tar: bad")) == "InputError: a.tar: bad"


def test_error_line__project_types_and_multiline_message():
    line = error_line(ShardError("a.tar: bad\n  second line"))
    assert line == "ShardError: a.tar: bad second line"


def test_error_line__worker_exception_reraised__named_by_its_type():
    text = ('Caught InputError in DataLoader worker process 0.\nOriginal Traceback (most recent '
            'call last):\n  File "/x/torch/utils/data/_utils/worker.py", line 1, in _worker_loop'
            '\n  File "/x/pipeline/data/loader.py", line 2, in f'
            '\npipeline.errors.InputError: loader: bad thing')
    assert error_line(InputError(text)) == "InputError: loader: bad thing"
    # PyTorch re-raises with the worker's exception type: a plain ValueError stays a bug
    assert error_line(ValueError(text.replace("InputError", "ValueError"))) is None


def test_error_line__dead_worker__named():
    line = error_line(RuntimeError("DataLoader worker (pid 3) is killed by signal: Killed. "))
    assert line.startswith("LoaderWorkerError: DataLoader worker (pid 3) was killed by SIGKILL, "
                           "as the out-of-memory killer does")


def test_stage_main__own_error__exit_1_one_line(tmp_path, capsys):
    import yaml
    from helpers import TINY  # a valid params file

    (tmp_path / "p.yaml").write_text(yaml.safe_dump(TINY))
    code = stage_main("x", lambda p: _raise(ShardError("s.tar: broken")),
                      ["--params", str(tmp_path / "p.yaml")])
    assert code == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == "error: ShardError: s.tar: broken"


def test_rerun_hint__inside_an_experiment(monkeypatch):
    monkeypatch.delenv("DVC_EXP_NAME", raising=False)
    assert rerun_hint() == "rerun `dvc repro` to continue"
    monkeypatch.setenv("DVC_EXP_NAME", "exp-1")
    assert "run the experiment again with the same params" in rerun_hint()
