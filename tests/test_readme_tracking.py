"""The README's tracking and export snippets (#30), run as written, and the export formats."""

import json
import os
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest
import torch
from registryhelpers import other_bytes, publish, score, train_tiny
from test_readme import readme_block, readme_python_blocks

from pipeline.moco.backbones import build_backbone, export_state_dict
from pipeline.train.export import save_safetensors

REPO = Path(__file__).resolve().parents[1]


def run_snippet(code: str, cwd: Path, **env: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO), **env}, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


@pytest.fixture(scope="module")
def registry(tmp_path_factory) -> Path:
    """A trained tiny encoder, registered twice; linear top-1 80 (version 1) then 75 (2)."""
    root = train_tiny(tmp_path_factory.mktemp("registry"))
    (root / "params.yaml").write_text("mlflow:\n  experiment: moco-pipeline\n")
    mp = pytest.MonkeyPatch()
    mp.chdir(root)
    mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root / 'mlflow.db'}")
    mp.setenv("DVC_EXP_NAME", "exp-a")
    try:
        publish()
        score("linear", 80.0)
        other_bytes()
        publish()
        score("linear", 75.0)
    finally:
        mp.undo()
        mlflow.set_tracking_uri(None)
    return root


def test_readme__comparing_runs_snippet_lists_versions_and_aliases(registry):
    out = run_snippet(readme_block("Compare runs"), registry,
                      MLFLOW_TRACKING_URI=f"sqlite:///{registry / 'mlflow.db'}")
    lines = out.strip().splitlines()
    eid = json.loads((registry / "runs/pretrain.json").read_text())["experiment_id"]
    assert lines[0] == (f"http://127.0.0.1:5000/#/experiments/{eid}/runs"
                        "?workflowType=machine_learning&viewStateShareKey=headline")
    assert lines[1] == "{'champion': 1, 'newest': 2}"  # 75 < 80: the champion stayed
    assert sorted(lines[2:]) == ["1 80 exp-a unknown", "2 75 exp-a unknown"]  # not a git repo


def test_readme__registry_snippet_loads_the_champion(registry):
    out = run_snippet(readme_block("Use the trained encoder", 1), registry,
                      MLFLOW_TRACKING_URI=f"sqlite:///{registry / 'mlflow.db'}")
    assert out.strip().splitlines()[-1] == "torch.Size([1, 32])"  # width 4: 8 * 4 features


def test_export__safetensors_equals_encoder_pt_with_json_metadata(tmp_path):
    from safetensors import safe_open

    root = train_tiny(tmp_path)
    sd = torch.load(root / "models/encoder.pt", weights_only=True)
    from safetensors.torch import load_file

    st = load_file(root / "models/encoder.safetensors")
    assert st.keys() == sd.keys()
    assert all(st[k].dtype == sd[k].dtype and torch.equal(st[k], sd[k]) for k in sd)
    with safe_open(root / "models/encoder.safetensors", "pt") as f:
        meta = {k: json.loads(v) for k, v in f.metadata().items()}
    assert meta == json.loads((root / "models/encoder.json").read_text())


@pytest.mark.parametrize("block", readme_python_blocks(), ids=lambda b: f"{b[0]}-{b[1]}")
def test_readme__every_python_block_runs(registry, block):
    # against the tiny trained, registered encoder: models/, data/shards/, mlflow.db
    heading, _, code = block
    if "timm" in code:
        pytest.importorskip("timm")  # the `dev` extra installs it
    out = run_snippet(code, registry, MLFLOW_TRACKING_URI=f"sqlite:///{registry / 'mlflow.db'}")
    assert out.strip(), heading  # each block prints what it shows


def test_readme__python_blocks_are_the_ones_checked_here():
    # a new block is run by test_readme__every_python_block_runs; this count makes its author
    # look at what it prints (the tests above check each block's output)
    assert [(h, i) for h, i, _ in readme_python_blocks()] == [
        ("Compare runs", 0), ("Use the trained encoder", 0), ("Use the trained encoder", 1),
        ("Use the trained encoder", 2)]


def _timm_from_readme(root: Path, monkeypatch) -> torch.nn.Module:
    """The README's timm block run in ``root``: its ``model``."""
    monkeypatch.chdir(root)
    scope: dict = {}
    exec(readme_block("Use the trained encoder", 2), scope)  # noqa: S102 - the README's code
    return scope["model"].eval()


@pytest.mark.parametrize("arch", [
    # the default params.yaml: width 32, grey, the 3x3 stride-2 stem without max-pool
    {"backbone": "resnet18", "width": 32, "in_channels": 1, "small_stem": True,
     "stem_stride": 2, "image_size": 28},
    # torchvision's own shape: width 64, RGB, the ImageNet stem
    {"backbone": "resnet18", "width": 64, "in_channels": 3, "small_stem": False,
     "stem_stride": 1, "image_size": 224},
    {"backbone": "resnet50", "width": 16, "in_channels": 3, "small_stem": True,
     "stem_stride": 1, "image_size": 32},
])
def test_readme__timm_snippet_gives_our_features_bit_for_bit(tmp_path, monkeypatch, arch):
    pytest.importorskip("timm")  # the `dev` extra installs it
    torch.manual_seed(0)
    ours = build_backbone(arch["backbone"], width=arch["width"], in_channels=arch["in_channels"],
                          small_stem=arch["small_stem"], stem_stride=arch["stem_stride"])
    for m in ours.modules():  # BN statistics other than the init's 0 / 1: they must load too
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.uniform_(-1, 1)
            m.running_var.uniform_(0.5, 2)
    ours.eval()
    (tmp_path / "models").mkdir()
    (tmp_path / "models/encoder.json").write_text(json.dumps(arch))
    save_safetensors(export_state_dict(ours), tmp_path / "models/encoder.safetensors", arch)
    model = _timm_from_readme(tmp_path, monkeypatch)  # load_state_dict: strict
    x = torch.randn(2, arch["in_channels"], 32, 32)
    with torch.no_grad():
        assert torch.equal(model(x), ours(x))
    assert model.num_features == ours.num_features  # 8 x width (x 4 for ResNet-50)


def test_export__safetensors_bytes_depend_only_on_the_inputs(tmp_path):
    # safetensors itself writes the metadata map in a random order per call: 8 saves of the
    # same weights and metadata gave up to 8 different md5s, and dvc.lock changed with them
    from safetensors import safe_open
    from safetensors.torch import load_file

    sd = {"a.w": torch.arange(6.0).reshape(2, 3), "b.b": torch.ones(3, dtype=torch.float64)}
    meta = {k: {"v": i, "nested": {"z": 1, "a": 2}} for i, k in enumerate("qwertyuiop")}
    blobs = set()
    for i in range(8):
        save_safetensors(sd, tmp_path / f"{i}.safetensors", meta)
        blobs.add((tmp_path / f"{i}.safetensors").read_bytes())
    assert len(blobs) == 1
    (data,) = blobs
    n = int.from_bytes(data[:8], "little")
    assert n % 8 == 0
    header = json.loads(data[8:8 + n])
    assert list(header["__metadata__"]) == sorted(meta)
    loaded = load_file(tmp_path / "0.safetensors")
    assert loaded.keys() == sd.keys() and all(torch.equal(loaded[k], sd[k]) for k in sd)
    with safe_open(tmp_path / "0.safetensors", "pt") as f:
        assert {k: json.loads(v) for k, v in f.metadata().items()} == meta


def test_export__safetensors_written_atomically_no_temp_left(tmp_path):
    sd = {"w": torch.arange(6.0).reshape(2, 3).t()}  # not contiguous: made so on save
    save_safetensors(sd, tmp_path / "e.safetensors", {"width": 4})
    from safetensors.torch import load_file

    assert torch.equal(load_file(tmp_path / "e.safetensors")["w"], sd["w"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e.safetensors"]
