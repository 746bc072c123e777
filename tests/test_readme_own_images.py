"""README "Your own images": every params snippet there is a valid params file once merged."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from pipeline.config import Params, from_dict, to_dict

ROOT = Path(__file__).resolve().parents[1]


def snippets() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Your own images\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"^```yaml\n(.*?)^```$", section, re.M | re.S)
    inline = re.findall(r"`(data: \{[^`]*\})`", section)
    return blocks + inline


def test_readme_own_images__three_recipes_are_there():
    assert len(snippets()) == 3


@pytest.mark.parametrize("snippet", snippets())
def test_readme_own_images__snippet_is_valid_params(snippet):
    tree = to_dict(Params())  # = params.yaml (test_params_yaml__equals_schema_defaults)
    for sec, vals in yaml.safe_load(snippet).items():
        tree[sec].update(vals)
    p = from_dict(tree)
    assert p.data.image_size == 64 and p.embed.pool_grid == 4  # the grid fits 64 px's layer3
    assert p.data.unlabelled_root or p.data.pretrain_shards
