"""The README's code, run exactly as written."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import build_tiny_shards, run_pretrain

REPO = Path(__file__).resolve().parents[1]


PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```$", flags=re.M | re.S)


def readme_python_blocks() -> list[tuple[str, int, str]]:
    """Every ```python block of the README: (its ``##`` section, index there, code)."""
    text = (REPO / "README.md").read_text()
    out = []
    for section in text.split("\n## ")[1:]:
        heading = section.split("\n", 1)[0]
        out += [(heading, i, code) for i, code in enumerate(PYTHON_BLOCK.findall(section))]
    return out


def readme_block(heading: str, index: int = 0) -> str:
    """The ``index``-th ```python block of the README section ``## heading``."""
    text = (REPO / "README.md").read_text()
    section = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    blocks = PYTHON_BLOCK.findall(section)
    assert len(blocks) > index, f"no python block {index} under '## {heading}'"
    return blocks[index]


def test_readme__use_the_trained_encoder_snippet_runs(tmp_path):
    # an encoder from the real pretraining and export code (tiny: width 4, 2 steps)
    shards = build_tiny_shards(tmp_path / "data/shards", n_pretrain=32, n_train=16, n_test=16)
    run_pretrain(shards, tmp_path / "models", {"moco": {"K": 16}, "pretrain": {"epochs": 1}})
    assert (tmp_path / "models/encoder.json").is_file()
    snippet = readme_block("Use the trained encoder")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", snippet], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    # width 4 ResNet-18: 8 * 4 = 32 features
    assert out.stdout.strip() == "torch.Size([1, 32])"


@pytest.mark.parametrize("backbone", ["resnet18", "resnet50"])
def test_readme__width_64_encoder_loads_into_stock_torchvision(backbone):
    # the README's claim for width 64, 3 channels, ImageNet stem (export without training)
    import torchvision

    from pipeline.moco.backbones import build_backbone, export_state_dict

    sd = export_state_dict(build_backbone(backbone, width=64, in_channels=3, small_stem=False))
    res = getattr(torchvision.models, backbone)().load_state_dict(sd, strict=False)
    assert sorted(res.missing_keys) == ["fc.bias", "fc.weight"] and res.unexpected_keys == []
