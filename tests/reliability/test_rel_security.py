"""Security: no code execution from checkpoints or shards, a local-only UI, no secrets logged."""

from __future__ import annotations

import ast
import io
import json
import pickle
import re
import tarfile

import pytest
from PIL import Image
from relhelpers import ROOT, mlflow_runs, rewrite_manifest, run_stage, write_params

from pipeline.config import ParamsError, from_dict
from pipeline.data.eval_loader import eval_loader
from pipeline.data.loader import read_manifest, train_loader
from pipeline.data.shards import ShardError, verify_shards
from pipeline.data.views import build_eval_transform
from pipeline.tracking import loggable_params


def python_files():
    return sorted((ROOT / "pipeline").rglob("*.py")) + sorted((ROOT / "stages").glob("*.py"))


def calls_to(tree: ast.AST, module: str, func: str) -> list[ast.Call]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute) and n.func.attr == func
            and isinstance(n.func.value, ast.Name) and n.func.value.id == module]


def test_source__every_torch_load__weights_only_true():
    found = 0
    for path in python_files():
        for call in calls_to(ast.parse(path.read_text()), "torch", "load"):
            found += 1
            kw = {k.arg: k.value for k in call.keywords}
            assert isinstance(kw.get("weights_only"), ast.Constant) and \
                kw["weights_only"].value is True, f"{path}:{call.lineno}"
    assert found >= 4  # checkpoint, encoder, head, features (the grep must not pass vacuously)
    text = "\n".join(p.read_text() for p in python_files())
    assert not re.search(r"allow_pickle\s*=\s*True", text)
    assert not re.search(r"\bweights_only\s*=\s*False", text)


class _Trap:
    """Unpickling this creates the marker file: proof that something unpickled."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def shard_with_member(split_dir, ext: str, marker) -> str:
    """Append a sample whose members are ``<key>.png``, ``<key>.cls`` and ``<key>.<ext>``
    (a pickle that would create ``marker``) to ``shard-000000.tar``; manifest kept consistent."""
    path = split_dir / "shard-000000.tar"
    with tarfile.open(path) as t:
        members = [(m, t.extractfile(m).read()) for m in t.getmembers()]
    buf = io.BytesIO()
    Image.new("L", (16, 16), 7).save(buf, format="PNG")
    key = "zz_evil"
    extra = {"png": buf.getvalue(), "cls": b"0", ext: pickle.dumps(_Trap(marker))}
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as t:
        for m, data in members[:2]:  # the evil sample comes second: readers meet it early
            t.addfile(m, io.BytesIO(data))
        for e, data in extra.items():
            info = tarfile.TarInfo(f"{key}.{e}")
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
        for m, data in members[2:]:
            t.addfile(m, io.BytesIO(data))
    path.write_bytes(out.getvalue())
    m = json.loads((split_dir / "manifest.json").read_text())
    m["shards"][0]["num_samples"] += 1
    m["num_samples"] += 1
    (split_dir / "manifest.json").write_text(json.dumps(m))
    rewrite_manifest(split_dir)
    return str(path)


READERS = {
    # a whole true epoch (batch 1): every sample of the split passes the member check
    "train_loader": lambda d: list(train_loader(d, batch_size=1, epoch=0, seed=0,
                                                steps=read_manifest(d).num_samples)),
    "eval_loader": lambda d: list(eval_loader(d, transform=build_eval_transform(
        16, (0.5,), (0.25,)), batch_size=8)),
    "verify_shards": verify_shards,
}


@pytest.mark.parametrize("reader", sorted(READERS))
@pytest.mark.parametrize("ext", ["pyd", "pickle"])
def test_shard_readers__pickle_member__refused_naming_shard_never_unpickled(
        ext, reader, tiny_shards, tmp_path):
    import shutil

    split = shutil.copytree(tiny_shards / "test", tmp_path / "test")
    marker = tmp_path / "unpickled"
    shard = shard_with_member(split, ext, marker)
    with pytest.raises(ShardError) as e:
        READERS[reader](split)
    assert shard in str(e.value) and f"'.{ext}'" in str(e.value) and "zz_evil" in str(e.value)
    assert not marker.exists()


def shard_with_key(split_dir, key: str) -> str:
    """Add a sample stored as tar members ``<key>.png`` + ``<key>.cls`` (PAX headers, so any
    name survives) as the second sample of ``shard-000000.tar``; manifest kept consistent."""
    path = split_dir / "shard-000000.tar"
    with tarfile.open(path) as t:
        members = [(m, t.extractfile(m).read()) for m in t.getmembers()]
    buf = io.BytesIO()
    Image.new("L", (16, 16), 7).save(buf, format="PNG")
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as t:
        for m, data in members[:2]:
            t.addfile(m, io.BytesIO(data))
        for ext, data in (("png", buf.getvalue()), ("cls", b"0")):
            info = tarfile.TarInfo(f"{key}.{ext}")
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
        for m, data in members[2:]:
            t.addfile(m, io.BytesIO(data))
    path.write_bytes(out.getvalue())
    m = json.loads((split_dir / "manifest.json").read_text())
    m["shards"][0]["num_samples"] += 1
    m["num_samples"] += 1
    (split_dir / "manifest.json").write_text(json.dumps(m))
    rewrite_manifest(split_dir)
    return str(path)


@pytest.mark.parametrize("reader", sorted(READERS))
@pytest.mark.parametrize(("key", "why"), [
    ("../x", "a '..' path component"), ("sub/../../etc/x", "a '..' path component"),
    ("/etc/x", "an absolute path")], ids=["dotdot", "nested-dotdot", "absolute"])
def test_shard_readers__unsafe_member_key__refused_naming_shard_and_key(
        key, why, reader, tiny_shards, tmp_path):
    import shutil

    split = shutil.copytree(tiny_shards / "test", tmp_path / "test")
    shard = shard_with_key(split, key)
    with tarfile.open(shard) as t:  # the tar really holds that name
        assert f"{key}.png" in t.getnames()
    with pytest.raises(ShardError) as e:
        READERS[reader](split)
    assert str(e.value) == f"{shard}: member key {key!r} refused ({why})"


def test_check_members__nul_in_key__refused():
    # A tar header cannot carry a NUL (Python's tarfile cuts the name there, PAX included), so
    # the check is tried on a record as the readers get it
    from pipeline.data.shards import check_members

    record = {"__key__": "a\0b", "__url__": "s.tar", "png": b"", "cls": b"0"}
    with pytest.raises(ShardError) as e:
        check_members(record)
    assert str(e.value) == "s.tar: member key 'a\\x00b' refused (holds a NUL character)"
    ok = {"__key__": "000123/0001", "__url__": "s.tar", "png": b"", "cls": b"0"}
    assert check_members(ok) is ok  # img2dataset-style sub-folder keys stay accepted


def test_verify_shards_cli__dotdot_member__one_line_exit_1(tiny_shards, tmp_path):
    import shutil
    import subprocess
    import sys

    split = shutil.copytree(tiny_shards / "test", tmp_path / "test")
    shard = shard_with_key(split, "../x")
    r = subprocess.run([sys.executable, "-m", "pipeline", "verify-shards", str(split)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert r.stderr.strip() == (f"error: verify-shards: {shard}: member key '../x' refused (a "
                                "'..' path component); rebuild with `dvc repro -f build_shards`")


def test_makefile__ui_target__binds_loopback_only():
    lines = (ROOT / "Makefile").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(r"^ui\s*:", line))
    recipe = []
    for line in lines[start + 1:]:
        if not line.startswith("\t"):
            break
        recipe.append(line)
    cmd = " ".join(recipe)
    assert "mlflow" in cmd and re.search(r"--host[ =]127\.0\.0\.1\b", cmd), cmd
    assert "0.0.0.0" not in cmd and "::" not in cmd


SECRET_ENV = {"AWS_SECRET_ACCESS_KEY": "rel-test-aws-secret-8c1f",
              "MLFLOW_TRACKING_PASSWORD": "rel-test-mlflow-pw-77ab",
              "MY_API_TOKEN": "rel-test-token-5e2d"}


@pytest.mark.parametrize("section", ["mlflow", "data", "pretrain"])
def test_params__password_key__refused_without_echoing_value(section):
    with pytest.raises(ParamsError) as e:
        from_dict({section: {"password": "hunter2-secret-value"}})
    assert f"{section}.password" in str(e.value)
    assert "hunter2-secret-value" not in str(e.value)


def test_loggable_params__secret_looking_name__refused(monkeypatch):
    import pipeline.tracking.provenance as tracking

    real = tracking.to_dict
    monkeypatch.setattr(tracking, "to_dict",
                        lambda p: {**real(p), "mlflow": {"api_token": "abc"}})
    with pytest.raises(ValueError, match="mlflow.api_token"):
        loggable_params(from_dict({}))


@pytest.mark.slow
def test_stage_run__mlflow_params_and_tags__no_environment_secrets(tmp_path, mlflow_db):
    images = tmp_path / "images"
    for c in ("a", "b"):
        (images / c).mkdir(parents=True)
        for i in range(5):
            Image.new("L", (8, 8), 20 * i).save(images / c / f"{i}.png")
    wd = tmp_path / "wd"
    write_params(wd / "params.yaml", {"data": {"source": "imagefolder", "root": str(images),
                                               "test_fraction": 0.4}}, mlflow=True)
    r = run_stage("build_shards", wd, db=mlflow_db, **SECRET_ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    (run,) = mlflow_runs(mlflow_db)
    assert run.info.status == "FINISHED"
    assert run.data.params["data.source"] == "imagefolder"
    logged = {**run.data.params, **run.data.tags}
    for k, v in logged.items():
        assert not any(s in v for s in SECRET_ENV.values()), k
        assert not any(s in k.lower() for s in ("password", "secret", "token")), k
