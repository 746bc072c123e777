"""``python -m pipeline compare``: every experiment on one screen.

``dvc exp show`` lists every param, metric and dependency hash of every experiment (over 200
columns here): at 160 columns each cell is an ellipsis. This table is made from the same data
(``dvc exp show --json``, DVC's documented output): one row per experiment (the workspace, each
commit shown and the experiments under it), then the params whose values differ between those
rows and the headline metrics of :data:`METRICS`. A table wider than ``width`` continues below
with the experiment column repeated (pandas ``DataFrame.to_string(line_width=...)``).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator, Sequence
from typing import Any

WIDTH = 160  # columns, when the terminal does not say
# column label -> (metrics file, keys inside it): MoCo's top-1s (kNN, linear probe), the same
# with 1 and 10 labelled images per class, kNN from the 20 images selection.method picks, the
# label-free RankMe and the pretraining time
METRICS: dict[str, tuple[str, tuple[str, ...]]] = {
    "knn.top1": ("metrics/knn.json", ("top1",)),
    "linear.top1": ("metrics/linear.json", ("top1",)),
    "knn@1": ("metrics/label_efficiency.json", ("knn", "1")),
    "knn@10": ("metrics/label_efficiency.json", ("knn", "10")),
    "linear@1": ("metrics/label_efficiency.json", ("linear", "1")),
    "linear@10": ("metrics/label_efficiency.json", ("linear", "10")),
    "picked20.knn": ("metrics/selection.json", ("at_20", "knn")),
    "rankme": ("metrics/pretrain.json", ("rankme",)),
    "pretrain_s": ("metrics/pretrain.json", ("wall_time_s",)),
}
# decimals shown (the files keep every digit): top-1s to 0.01 point, as metrics/ rounds them
DECIMALS = {"rankme": 1, "pretrain_s": 0}
TOP1_DECIMALS = 2
LEGEND = ("knn@n, linear@n: top-1 (%) with n labelled images per class; picked20.knn: kNN "
          "top-1 (%) from the 20 images selection.method picks; pretrain_s: seconds. "
          "Every metric: dvc exp show; every number: eval/metrics/.")


def experiments(shown: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(label, the ``data`` of ``dvc exp show --json``) of every row, in DVC's order.

    Args:
        shown: ``dvc exp show --json``: a list of commits (the workspace first), each with its
            ``experiments`` (``[{"name", "revs": [{"rev", "name", "data", ...}]}]``, or None).
    """
    for commit in shown:
        rev = commit["rev"]  # "workspace", or a commit's sha (its branch or tag is its name)
        label = commit.get("name") or (rev if rev == "workspace" else rev[:7])
        yield label, commit.get("data") or {}
        for exp in commit.get("experiments") or []:
            for rev in exp.get("revs") or []:
                yield f"  {rev.get('name') or rev['rev'][:7]}", rev.get("data") or {}


def _flat(obj: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(obj, dict):
        return {prefix: obj}
    return {k: v for key, sub in obj.items() for k, v in _flat(sub, f"{prefix}{key}.").items()}


def params_of(data: dict[str, Any]) -> dict[str, Any]:
    """Dotted params of one row (``pretrain.lr``; another params file's keys as ``file:key``)."""
    out = {}
    for file, entry in (data.get("params") or {}).items():
        prefix = "" if file == "params.yaml" else f"{file}:"
        out |= {prefix + k.removesuffix("."): v
                for k, v in _flat((entry or {}).get("data") or {}).items()}
    return out


def metric_of(data: dict[str, Any], file: str, keys: Sequence[str]) -> Any:
    """The number at ``keys`` in ``file``'s metrics of one row, or None."""
    value: Any = ((data.get("metrics") or {}).get(file) or {}).get("data")
    for k in keys:
        value = value.get(k) if isinstance(value, dict) else None
    return value


def table(shown: list[dict[str, Any]]) -> Any:
    """The comparison as a ``pandas.DataFrame``, one row per experiment.

    Columns: the params whose values differ between the rows (in params.yaml order), then
    :data:`METRICS` (missing where a row has none: a queued or failed experiment).
    """
    import pandas as pd

    rows = list(experiments(shown))
    params = [params_of(data) for _, data in rows]
    names = list(dict.fromkeys(k for p in params for k in p))
    changed = [k for k in names
               if len({json.dumps(p.get(k), sort_keys=True) for p in params}) > 1]
    cells = [{**{k: _text(p.get(k)) for k in changed},
              **{label: metric_of(data, file, keys) for label, (file, keys) in METRICS.items()}}
             for p, (_, data) in zip(params, rows)]
    return pd.DataFrame(cells, index=[label for label, _ in rows],
                        columns=[*changed, *METRICS]).rename_axis("experiment")


def _text(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    return json.dumps(value)  # lists and booleans as params.yaml would spell them


def render(shown: list[dict[str, Any]], width: int) -> str:
    """The table as text, no line longer than ``width`` (unless one column is)."""
    frame = table(shown).astype(object)
    for label in METRICS:
        digits = DECIMALS.get(label, TOP1_DECIMALS)
        frame[label] = [f"{v:.{digits}f}" if isinstance(v, (int, float)) else v
                        for v in frame[label]]
    frame = frame.where(lambda f: f.notna(), "-")
    return frame.to_string(line_width=width) + "\n" + textwrap.fill(LEGEND, width)


def compare_main(width: int | None = None) -> int:
    """CLI hook for ``python -m pipeline compare``: print :func:`render` of this repo.

    Args:
        width: the longest line; None = the terminal's width, else :data:`WIDTH`.

    Returns:
        Exit code: 0, or 1 when ``dvc exp show`` failed (its last error line printed).
    """
    res = subprocess.run([sys.executable, "-m", "dvc", "exp", "show", "--json"],
                         capture_output=True, text=True)
    if res.returncode != 0:
        lines = [ln for ln in res.stderr.splitlines() if ln.strip()] or ["no output"]
        print(f"error: compare: dvc exp show --json failed: {lines[-1]}", file=sys.stderr)
        return 1
    width = width or shutil.get_terminal_size((WIDTH, 24)).columns
    print(render(json.loads(res.stdout or "[]"), width))
    return 0
