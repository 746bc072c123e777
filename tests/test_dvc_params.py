"""dvc.yaml params follow the code: the report stage lists exactly the ``data.*`` keys it reads.

DVC reruns a stage when one of its listed params changes. The report once listed the whole
``data`` section, so the same shards spelled another way in ``data.pretrain_shards`` reran it
for nothing. The keys are derived here from the report package's source (attribute reads
``<params>.data.<key>``, also through an alias ``d = params.data``), so the list cannot drift.
"""

from __future__ import annotations

import ast
from pathlib import Path

import yaml

from pipeline.config import DataParams

REPO = Path(__file__).resolve().parents[1]
REPORT_CODE = [REPO / "stages/report.py", *sorted((REPO / "pipeline/report").rglob("*.py"))]
DATA_KEYS = set(DataParams.model_fields)


def data_reads(paths: list[Path], root: Path = REPO) -> tuple[set[str], list[str]]:
    """``(keys, whole)``: the ``data.<key>`` reads in ``paths``, and the uses of a whole
    ``.data`` section (passed on, or read by a name that is no field), as ``file:line``
    (relative to ``root``)."""
    keys: set[str] = set()
    whole: list[str] = []
    for path in paths:
        tree = ast.parse(path.read_text(), filename=str(path))
        aliases: set[str] = set()
        aliased: set[int] = set()  # id() of the `.data` nodes bound to an alias
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign):
                pairs = [(node.targets[0], node.value)]
                if isinstance(node.targets[0], ast.Tuple) and isinstance(node.value, ast.Tuple):
                    pairs = list(zip(node.targets[0].elts, node.value.elts))
                for target, value in pairs:
                    if (isinstance(target, ast.Name) and isinstance(value, ast.Attribute)
                            and value.attr == "data"):
                        aliases.add(target.id)
                        aliased.add(id(value))
        read: set[int] = set()
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute):
                continue
            inner = node.value
            section = (isinstance(inner, ast.Attribute) and inner.attr == "data") or (
                isinstance(inner, ast.Name) and inner.id in aliases)
            if section:
                read.add(id(inner))
                if node.attr in DATA_KEYS:
                    keys.add(node.attr)
                else:
                    whole.append(f"{path.relative_to(root)}:{node.lineno} .{node.attr}")
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr == "data"
                    and id(node) not in read | aliased):
                whole.append(f"{path.relative_to(root)}:{node.lineno}")
    return keys, whole


def stage_params(stage: str) -> list[str]:
    return yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"][stage]["params"]


def test_report_params__exactly_the_data_keys_the_report_reads():
    keys, whole = data_reads(REPORT_CODE)
    assert whole == [], ("the report uses the whole data section here; list it in dvc.yaml's "
                         "report params, or read single keys")
    listed = {p.removeprefix("data.") for p in stage_params("report") if p.startswith("data")}
    assert "data" not in stage_params("report")
    assert listed == keys
    # read by hand in pipeline/report/: the settings table and title (source, root,
    # image_size; the pretraining images: pretrain_labelled, unlabelled_root), the published
    # reference (source, root), the shards it reads (shards_dir)
    assert keys == {"source", "root", "image_size", "shards_dir", "pretrain_labelled",
                    "unlabelled_root"}


def test_data_reads__finds_aliases_and_whole_section_uses(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("def f(params, p):\n"
                   "    d, m = params.data, params.model\n"
                   "    x = d.root + p.data.source\n"
                   "    g(p.data)\n"
                   "    return m.width, row.data.shape\n")
    keys, whole = data_reads([src], tmp_path)
    assert keys == {"root", "source"}
    assert sorted(whole) == ["m.py:4", "m.py:5 .shape"]
