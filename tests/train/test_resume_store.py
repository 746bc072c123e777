"""The resume store: main repo (DVC_ROOT), one folder per fingerprint, bounded."""

import json
import os

import pytest
import torch
from helpers import TINY, build_tiny_shards, run_pretrain

from pipeline.train import resume_store as rs


def _entry(root, key: str, mtime: float) -> None:
    d = root / rs.STORE / key
    d.mkdir(parents=True)
    (d / "last.pt").write_bytes(b"x")
    os.utime(d / "last.pt", (mtime, mtime))


def test_store_root__dvc_root_else_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DVC_ROOT", raising=False)
    assert rs.store_root() == rs.STORE  # relative: the working directory is the repo
    main = tmp_path / "main"
    main.mkdir()
    monkeypatch.setenv("DVC_ROOT", str(main))  # a queued experiment's temp workspace
    assert rs.store_root() == main / ".checkpoints/pretrain"
    assert rs.entry_dir("0123456789abcdef" + "0" * 48) == main / rs.STORE / "0123456789abcdef"


def test_open_entry__keeps_the_newest_and_never_the_one_opened(tmp_path):
    for i, key in enumerate(["a" * 16, "b" * 16, "c" * 16]):
        _entry(tmp_path, key, 1000.0 + i)  # c newest, a oldest
    (tmp_path / rs.STORE / "notes").mkdir()  # not an entry: left alone
    here = rs.open_entry("d" * 64, root=tmp_path, keep=2)
    assert here == tmp_path / rs.STORE / ("d" * 16)
    # keep 2 = the one opened + the newest other (c); a and b go
    assert sorted(p.name for p in (tmp_path / rs.STORE).iterdir()) == ["c" * 16, "notes"]
    # an old entry opened again is protected, whatever its age
    assert rs.open_entry("c" * 64, root=tmp_path, keep=1).is_dir()


def test_clean_main__keep_n(tmp_path, capsys):
    for i, key in enumerate(["a" * 16, "b" * 16, "c" * 16]):
        _entry(tmp_path, key, 1000.0 + i)
    assert rs.clean_main(keep=1, root=tmp_path) == 0
    assert [p.name for p in rs.entries(tmp_path)] == ["c" * 16]
    assert rs.clean_main(keep=0, root=tmp_path) == 0
    assert rs.entries(tmp_path) == []
    assert capsys.readouterr().out.splitlines()[-1].endswith("removed 1 checkpoint folder(s), "
                                                             "kept 0")
    assert rs.clean_main(keep=-1, root=tmp_path) == 1


def test_pretrain__stage_key__checkpoint_in_the_fingerprint_folder(tmp_path):
    # the stage's way: the key computed once, its store folder given to the engine
    from pipeline.config import from_dict
    from pipeline.data.shards import read_manifest
    from pipeline.train.training_input import training_input

    shards = build_tiny_shards(tmp_path / "shards", n_pretrain=32, n_train=16, n_test=16)
    overrides = {"moco": {"K": 16}, "pretrain": {"epochs": 1}}
    tree = json.loads(json.dumps(TINY))
    for sec, vals in overrides.items():
        tree[sec].update(vals)
    p = from_dict(tree)
    key = training_input(p, read_manifest(shards / "pretrain"), 1)
    where = rs.open_entry(key.fingerprint, root=tmp_path / "repo")
    run_pretrain(shards, tmp_path / "out", overrides, checkpoint_dir=where, resume_key=key)
    ck = torch.load(tmp_path / "repo" / rs.STORE / key.fingerprint[:16] / "last.pt",
                    weights_only=True)
    assert ck["fingerprint"] == key.fingerprint and ck["step"] == 2


def _failing_loader_after(monkeypatch, n_batches: int) -> None:
    """The loaders yield ``n_batches`` batches in all, then fail as a deleted shard does."""
    import pipeline.train.engine as engine
    from pipeline.data.shards import ShardError

    real, served = engine.train_loader, {"n": 0}

    def loader(*a, **k):
        for batch in real(*a, **k):
            if served["n"] == n_batches:
                raise ShardError("pretrain/shard-000000.tar: shard listed in the manifest is "
                                 "missing")
            served["n"] += 1
            yield batch

    monkeypatch.setattr(engine, "train_loader", loader)


def test_pretrain__data_fails_in_an_abandoned_workspace__checkpoint_and_terminated(
        tiny_shards, tmp_path, monkeypatch):
    from pipeline.signals import Terminated

    _failing_loader_after(monkeypatch, 3)  # checkpoints every 2 steps: the last one at step 2
    with pytest.raises(Terminated, match=r"^workspace abandoned: checkpoint written at step 3 "
                                         r"to \S+last\.pt$") as e:
        run_pretrain(tiny_shards, tmp_path, abandoned=lambda: True)
    assert e.value.exit_code == 143
    assert torch.load(tmp_path / "ckpt/last.pt", weights_only=True)["step"] == 3


def test_pretrain__data_fails_in_a_live_workspace__the_data_error(tiny_shards, tmp_path,
                                                                  monkeypatch):
    from pipeline.data.shards import ShardError

    _failing_loader_after(monkeypatch, 3)
    with pytest.raises(ShardError, match="shard listed in the manifest is missing"):
        run_pretrain(tiny_shards, tmp_path, abandoned=lambda: False)
    assert torch.load(tmp_path / "ckpt/last.pt", weights_only=True)["step"] == 2


def test_workspace_watch__abandoned_when_the_parent_changes_or_the_folder_goes(tmp_path):
    from pipeline.train.resume_store import WorkspaceWatch

    assert not WorkspaceWatch().abandoned()  # not in an experiment workspace: never
    here = WorkspaceWatch(os.getppid(), str(tmp_path))
    assert not here.abandoned() and here.reason is None
    orphan = WorkspaceWatch(os.getppid() + 1_000_000, str(tmp_path))
    assert orphan.abandoned() and f"pid {os.getppid() + 1_000_000}) is gone" in orphan.reason
    gone = WorkspaceWatch(os.getppid(), str(tmp_path / "deleted"))
    assert gone.abandoned() and gone.reason.endswith("deleted was deleted")
