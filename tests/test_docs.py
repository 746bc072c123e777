"""The docs hold: every shell command in README.md and docs/*.md is accounted for, and the
README's checkable claims agree with dvc.yaml, metrics/ and the code.

A command is one logical line of a ```bash / ```sh / ```console block (``&&`` splits it; in a
console block only ``$ `` lines count). Each must be a key of COMMANDS, which says how it is
verified:

* ``Ran(file, text)``: an existing test or CI runs it; ``file`` holds ``text``, the code that
  runs it, so the pointer cannot silently rot. ``note`` says where it differs from the doc.
* ``Here()``: this file runs it, in a sandbox (cheap and read-only: ``check-params``,
  ``verify-shards`` on tiny shards, ``cp``).
* ``Parsed()``: nothing runs it (a long run, a server, a benchmark, a read-only report); this file
  checks it with the tool's own parser and checks the claim in its comment, if any.
* ``Untested(reason)``: it cannot run on one machine; the doc line's comment must say
  ``untested`` too, so the reader knows.

Every command of a tool with a parser is also parsed by that tool (dvc's own argparse, torchrun's,
``make -n``, the flags a benchmark script declares), whatever its entry, so a mistyped flag fails
even where the command runs only in a slow test. A command missing from COMMANDS fails, and so
does an entry no doc uses any more. The history in results/ is not checked: its commands are a
record of what was run then.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from helpers import shipped_versions

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(bash|sh|shell|console)\n(.*?)^```$", re.M | re.S)


@dataclass(frozen=True)
class Ran:
    where: str
    text: str
    note: str = ""


@dataclass(frozen=True)
class Here:
    pass


@dataclass(frozen=True)
class Parsed:
    pass


@dataclass(frozen=True)
class Untested:
    reason: str


E2E = "tests/e2e/test_pipeline.py"
EXP = "tests/e2e/test_experiments.py"
KILL9 = "tests/e2e/test_queue_kill9.py"
COMMANDS = {
    # README.md
    "make run": Parsed(),  # `make -n run`; its `dvc repro` is run by the e2e tests
    "make test": Ran(".ci/run", "\nmake test\n"),
    "python -m pipeline check-params --params configs/cifar10-r18.yaml": Here(),
    "cp configs/cifar10-r18.yaml params.yaml": Ran(
        E2E, 'make_repo(dst, params({}, tiny=None)', "configs/ci.yaml as params.yaml"),
    "dvc repro": Ran(E2E, 'output = text_of(sh(["dvc", "repro"], dst, env))'),
    "dvc repro data_insights": Ran("tests/e2e/test_own_folders.py",
                                   'sh(["dvc", "repro", "data_insights"], dst, env)',
                                   "data.source none with an unlabelled tree"),
    "dvc exp run -S pretrain.lr=0.06": Ran(
        E2E, '["dvc", "exp", "run", "-S", "pretrain.lr=0.05"]', "lr 0.05"),
    "dvc exp run -S linear.lr=10": Parsed(),  # + its `# reruns` comment against dvc.yaml
    "dvc exp run --queue -S knn.select=fixed -S knn.k=20": Ran(
        EXP, '["dvc", "exp", "run", "--queue", "knn", "-S", f"knn.k={k}"]',
        "knn.k only, up to knn"),
    "dvc queue start": Ran(EXP, '["dvc", "queue", "start", "-j", "3"]', "with -j 3"),
    "python -m pipeline compare": Ran(EXP, '[sys.executable, "-m", "pipeline", "compare"]',
                                      "on the workspace and three queued experiments"),
    "dvc exp show -n 3": Parsed(),
    "dvc metrics diff": Parsed(),
    "dvc plots show": Ran("tests/test_dvc_plots.py", '[dvc, "plots", "show", "--json"]',
                          "with --json"),
    "make ui": Parsed(),  # a server
    "make lint": Ran(".ci/run", "\nmake lint\n"),
    "make test-fast": Parsed(),
    "make bench": Parsed(),  # benchmarks are never timed tests
    # docs/pipeline.md
    "python3 -m venv .venv": Ran("Makefile", "$(PYTHON) -m venv $(VENV)", "make setup, in CI"),
    ". .venv/bin/activate": Ran("Makefile", "export PATH := $(abspath $(BIN)):$(PATH)",
                                "make puts .venv/bin first on PATH instead"),
    "pip install torch==2.14.1 torchvision==0.29.1": Ran(
        "Makefile", "pip install --disable-pip-version-check -q torch==2.14.1 torchvision==0.29.1"),
    "pip install -e '.[dev]'": Ran("Makefile", "pip install --disable-pip-version-check -q -e "
                                   "'.[dev]'"),
    "sudo apt-get install dataset-fashion-mnist": Ran(
        "Makefile", "apt-get install -y -q dataset-fashion-mnist", "as root, without sudo"),
    "python -m pipeline check-params --params params.yaml": Here(),
    "dvc repro -f -s pretrain": Ran(EXP, '["dvc", "repro", "-f", "-s", "knn"]', "on knn"),
    "python -m pipeline verify-shards data/shards": Here(),
    "dvc queue status": Ran(KILL9, '["dvc", "queue", "status"]'),
    "dvc queue kill my-exp": Ran(KILL9, '["dvc", "queue", "kill", "doomed"]',
                                 "after kill -9 of the worker's process group"),
    "dvc queue remove --failed": Ran(KILL9, '["dvc", "queue", "remove", "--failed"]'),
    "dvc exp run --queue -n my-exp -S pretrain.lr=0.06": Ran(
        KILL9, '["dvc", "exp", "run", "--queue", "-n", "doomed", "pretrain"]',
        "the same experiment queued again, without -S"),
    # docs/tracking.md
    "python -m pipeline relocate-mlflow": Ran(
        "tests/test_relocate.py", '[sys.executable, "-m", "pipeline", "relocate-mlflow", *args]',
        "after moving a tiny repo with a registered, scored encoder"),
    # docs/data.md
    "cp params.yaml params-remote.yaml": Here(),
    "python -m pipeline check-params --params params-remote.yaml": Here(),
    "python benchmarks/fmnist_unlabelled_tree.py --out data/raw/fmnist-unlabelled": Ran(
        "tests/e2e/test_fmnist_tree.py", '"benchmarks/fmnist_unlabelled_tree.py"),',
        "--limit 600 into a tmp folder"),
    "cp configs/fashion-mnist-unlabelled.yaml params.yaml": Ran(
        "tests/e2e/test_fmnist_tree.py", '(ROOT / "configs/fashion-mnist-unlabelled.yaml")',
        "loaded, shrunk to a tiny model and 300/200 labels, written as params.yaml"),
    "touch data/raw/photos/IMG_0042.jpg": Ran(
        "tests/e2e/test_refusals.py", 'sh(["touch", str(photo)], dst, env)',
        "on a photo of the test's folder, rewritten with the same size and mtime"),
    "python stages/pretrain.py --params params-remote.yaml": Ran(
        "tests/train/test_url_multinode.py", '[sys.executable, str(ROOT / "stages/pretrain.py"), '
        '"--params",', "a params file whose data.shards_dir is an http URL"),
    # docs/scaling.md
    "torchrun --nproc_per_node 4 stages/pretrain.py": Ran(
        "tests/train/test_train.py", '"torch.distributed.run", "--nproc_per_node", "2"',
        "2 processes on the pretrain library function"),
    "torchrun --nnodes 2 --node-rank 0 --nproc_per_node 8 --rdzv-backend c10d --rdzv-endpoint "
    "node0.example:29400 --rdzv-id moco-run-1 stages/pretrain.py --params params-remote.yaml":
        Untested("needs two machines; tests/train/test_url_multinode.py runs two torchrun "
                 "agents on 127.0.0.1 instead"),
    "dvc remote add -d storage /mnt/team/dvc-store": Ran(
        EXP, '["dvc", "remote", "add", "-d", "store", str(dst.parent / "remote")]',
        "a tmp directory"),
    "git add .dvc/config": Ran(EXP, '["git", "add", "-A"]', "git add -A"),
    'git commit -m "DVC remote"': Ran(EXP, '["git", "commit", "-qm", "repro"]'),
    "dvc push": Ran(EXP, '["dvc", "push"]'),
    "git clone /path/to/repo moco": Ran(EXP, '["git", "clone", "-q", str(dst), str(clone)]'),
    "cd moco": Ran(EXP, 'sh(["dvc", "pull"], clone, env)', "the next commands run in the clone"),
    "dvc pull": Ran(EXP, 'sh(["dvc", "pull"], clone, env)'),
    # docs/performance.md
    # docs/insights.md
    "python benchmarks/near_duplicates.py": Parsed(),
    "python benchmarks/planted_outliers.py photos --out /tmp/planted --steps 0": Parsed(),
    "python benchmarks/planted_outliers.py fmnist --out /tmp/planted --steps 300": Parsed(),
    "python benchmarks/pretrain_step.py --precision fp32": Parsed(),
    "python benchmarks/width_precision.py --widths 16 32 48": Parsed(),
    "python benchmarks/gpu.py": Parsed(),
    "python benchmarks/photo_loader.py --rounds 7": Parsed(),
}


def split_comment(line: str) -> tuple[str, str]:
    """``(code, comment)``: the comment starts at a ``#`` outside quotes after a blank."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].strip(), line[i + 1:].strip()
    return line.strip(), ""


def doc_commands() -> list[tuple[str, int, str, str]]:
    """``(doc, line, command, comment)`` of every shell command in the docs, in order."""
    found = []
    for doc in DOCS:
        text = doc.read_text()
        for m in FENCE.finditer(text):
            lineno = text.count("\n", 0, m.start(2)) + 1
            logical, first = "", lineno
            for i, raw in enumerate(m.group(2).splitlines()):
                if m.group(1) == "console":
                    if not raw.startswith("$ "):
                        continue
                    raw = raw[2:]
                if not logical:
                    first = lineno + i
                if raw.rstrip().endswith("\\"):
                    logical += raw.rstrip()[:-1] + " "
                    continue
                code, comment = split_comment(logical + raw)
                logical = ""
                for part in code.split("&&"):
                    if part.strip():
                        found.append((doc.name, first, " ".join(part.split()), comment))
    return found


FOUND = doc_commands()


def test_docs__every_command_is_accounted_for():
    unknown = [f"{doc}:{line}: {cmd}" for doc, line, cmd, _ in FOUND if cmd not in COMMANDS]
    assert not unknown, ("commands that no test runs, checks or marks untested; add each to "
                         "COMMANDS in tests/test_docs.py:\n" + "\n".join(unknown))


def test_docs__no_stale_entries():
    used = {cmd for _, _, cmd, _ in FOUND}
    assert sorted(set(COMMANDS) - used) == []


@pytest.mark.parametrize("doc, line, cmd, comment", FOUND,
                         ids=[f"{d}:{n}" for d, n, _, _ in FOUND])
def test_docs__command_is_verified(doc, line, cmd, comment, sandbox):
    how = COMMANDS.get(cmd)
    if how is None:
        pytest.fail(f"{doc}:{line}: `{cmd}` is not in COMMANDS")
    parse(cmd)
    if isinstance(how, Ran):
        path = REPO / how.where
        assert path.is_file(), f"{doc}:{line}: {how.where} does not exist"
        assert how.text in path.read_text(), f"{doc}:{line}: {how.where} no longer runs `{cmd}`"
    elif isinstance(how, Here):
        res = subprocess.run(["bash", "-c", cmd], cwd=sandbox, capture_output=True, text=True,
                             timeout=300, env=_env())
        assert res.returncode == 0, f"{doc}:{line}: `{cmd}` failed:\n{res.stderr[-2000:]}"
    elif isinstance(how, Untested):
        assert how.reason and "untested" in comment, (
            f"{doc}:{line}: `{cmd}` is not run by any test: its comment must say `untested` "
            f"and why ({how.reason})")


def parse(cmd: str) -> None:
    """Check ``cmd`` with its tool's own parser where one exists (nothing is executed)."""
    argv = shlex.split(cmd)
    tool, args = argv[0], argv[1:]
    if tool == "dvc":
        from dvc.cli import DvcParserError, parse_args

        try:
            parse_args(args)
        except DvcParserError as e:
            pytest.fail(f"dvc rejects `{cmd}`: {e}")
    elif tool == "torchrun":
        from torch.distributed.run import get_args_parser

        try:
            ns = get_args_parser().parse_args(args)
        except SystemExit:
            pytest.fail(f"torchrun rejects `{cmd}`")
        assert (REPO / ns.training_script).is_file(), ns.training_script
    elif tool == "make":
        res = subprocess.run(["make", "-n", *args], cwd=REPO, capture_output=True, text=True,
                             timeout=60)
        assert res.returncode == 0, f"`make -n {' '.join(args)}`: {res.stderr}"
    elif tool == "python" and args and args[0].startswith(("benchmarks/", "stages/")):
        script = REPO / args[0]
        assert script.is_file(), args[0]
        declared = set(re.findall(r"add_argument\(\s*\"(--[\w-]+)\"", script.read_text()))
        if args[0].startswith("stages/"):
            declared = {"--params"}  # pipeline.cli.stage_main
        used = {a for a in args[1:] if a.startswith("--")}
        assert used <= declared, f"{args[0]} does not declare {sorted(used - declared)}"
    elif argv[:3] == ["python", "-m", "pipeline"]:
        assert args[2] in ("check-params", "verify-shards", "relocate-mlflow", "compare"), cmd
    elif tool in ("cp", "cd"):
        assert len(args) in (1, 2), cmd


def _env() -> dict[str, str]:
    import os

    return {**os.environ, "PYTHONPATH": str(REPO),
            "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}


@pytest.fixture
def sandbox(tmp_path, tiny_shards) -> Path:
    """A working copy for ``Here`` commands: params, presets, tiny shards, params-remote.yaml.

    ``params-remote.yaml`` is what docs/data.md says to make: params.yaml with
    ``data.shards_dir`` set to a URL.
    """
    shutil.copy(REPO / "params.yaml", tmp_path / "params.yaml")
    shutil.copytree(REPO / "configs", tmp_path / "configs")
    shutil.copytree(tiny_shards, tmp_path / "data/shards")
    text = (REPO / "params.yaml").read_text()
    remote = re.sub(r"^(  shards_dir:) data/shards", r"\1 https://host/shards", text, flags=re.M)
    assert remote != text
    (tmp_path / "params-remote.yaml").write_text(remote)
    return tmp_path


# --- "reruns ..." comments of `dvc exp run` against dvc.yaml --------------------------------


def _dvc_stages() -> dict[str, dict]:
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    text = (REPO / "dvc.yaml").read_text().replace("${data.shards_dir}",
                                                   params["data"]["shards_dir"])
    return yaml.safe_load(text)["stages"]


def _names(entries: list) -> list[str]:
    return [next(iter(e)) if isinstance(e, dict) else e for e in entries or []]


def _outs(stage: dict) -> list[str]:
    return [o for kind in ("outs", "metrics", "plots") for o in _names(stage.get(kind))]


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def rerun_set(keys: list[str]) -> set[str]:
    """Stages that ``dvc exp run -S key=...`` reruns: readers of the keys, then downstream.

    ``check_params`` depends on the whole params.yaml, so it always reruns, but its stamp has
    the same bytes for every valid file (tests/test_config.py): nothing reruns because of it;
    ``check_data``'s and ``check_eval``'s stamps are content-stable too.
    An ``always_changed`` stage (``index_shards``) runs every time; its outputs change only
    with the data it indexes (tests/e2e/test_remote_shards.py), never with a params change.
    """
    stages = _dvc_stages()
    stable = {"check_params", "check_data", "check_eval"} | {n for n, st in stages.items()
                                               if st.get("always_changed")}
    hit = {name for name, st in stages.items()
           if "params.yaml" in st.get("deps", []) or st.get("always_changed")
           or any(k == p or k.startswith(p + ".") for k in keys for p in _names(st.get("params")))}
    while True:
        more = {name for name, st in stages.items() if name not in hit
                and any(_under(d, o) for d in st.get("deps", [])
                        for up in hit - stable for o in _outs(stages[up]))}
        if not more:
            return hit
        hit |= more


RERUNS = [(doc, line, cmd, comment) for doc, line, cmd, comment in FOUND
          if cmd.startswith("dvc exp run") and comment.startswith("reruns ")]


def test_docs__reruns_comments_exist():
    assert len(RERUNS) >= 3  # README's compare-runs block


@pytest.mark.parametrize("doc, line, cmd, comment", RERUNS, ids=[f"{d}:{n}" for d, n, *_ in RERUNS])
def test_docs__reruns_comment_matches_dvc_yaml(doc, line, cmd, comment):
    argv = shlex.split(cmd)
    keys = [argv[i + 1].split("=", 1)[0] for i, a in enumerate(argv) if a == "-S"]
    claimed = {s.strip() for s in comment.removeprefix("reruns ").split(",")}
    assert claimed == rerun_set(keys), f"{doc}:{line}: `{cmd}`"


def test_rerun_set__matches_the_e2e_tests():
    # the sets tests/e2e/test_pipeline.py measured with `dvc exp run`
    assert rerun_set(["knn.k"]) == {"check_params", "index_shards", "knn", "report"}
    assert rerun_set(["pretrain.lr"]) == {"check_params", "index_shards", "pretrain",
                                          "data_insights", "embed", "knn", "linear",
                                          "label_efficiency", "select_labels", "report"}


# --- README tables ---------------------------------------------------------------------------


def readme_section(heading: str) -> str:
    text = (REPO / "README.md").read_text()
    assert f"\n## {heading}\n" in text, heading
    return text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]


def table_rows(section: str) -> list[list[str]]:
    rows = [[c.strip() for c in ln.strip().strip("|").split("|")]
            for ln in section.splitlines() if ln.startswith("|")]
    return [r for r in rows[2:]]  # header and rule


def expand(path: str) -> list[str]:
    """``a/{b,c}.d`` -> ``a/b.d``, ``a/c.d`` (one brace group)."""
    m = re.search(r"\{([^}]*)\}", path)
    if not m:
        return [path.rstrip("/")]
    return [path[:m.start()] + alt + path[m.end():] for alt in m.group(1).split(",")]


def test_readme__pipeline_table_matches_dvc_yaml():
    stages = _dvc_stages()
    rows = table_rows(readme_section("The pipeline"))
    assert [r[0].strip("`") for r in rows] == list(stages)
    for row in rows:
        name = row[0].strip("`")
        listed = [p for tok in re.findall(r"`([^`]+)`", row[2]) for p in expand(tok)]
        listed = [p for p in listed if "/" in p or p in _outs(stages[name])]
        outs = [o for o in _outs(stages[name])
                if o not in (f"runs/{name}.json", f"eval/metrics/{name}.json")]
        # what the README lists is written by the stage, and every output is listed
        for p in listed:
            assert any(_under(p, o) for o in _outs(stages[name])) or p.startswith("reports/"), \
                (name, p)
        for o in outs:
            assert any(_under(p, o) for p in listed), (name, o)
    # "every stage also writes runs/<stage>.json"; "beside metrics/<stage>.json ...
    # eval/metrics/<stage>.json"
    assert all(f"runs/{n}.json" in _outs(st) for n, st in stages.items())
    assert all(f"eval/metrics/{n}.json" in _outs(st) for n, st in stages.items()
               if f"metrics/{n}.json" in _outs(st))


def _json(path: str) -> dict:
    import json

    return json.loads((REPO / path).read_text())


def _metrics_sets() -> list[dict[str, dict]]:
    """metrics/{baselines,knn,linear}.json as in the workspace and, when they differ, as
    committed (see :func:`helpers.shipped_versions`)."""
    import json

    names = ("baselines", "knn", "linear")
    texts = {n: shipped_versions(f"metrics/{n}.json") for n in names}
    sets = [{n: json.loads(t[0]) for n, t in texts.items()},
            {n: json.loads(t[-1]) for n, t in texts.items()}]
    return sets[:1] if sets[0] == sets[1] else sets


# every number of the committed default run (metrics/ holds its headline, eval/metrics/ the rest
# but eval/ is not in git): the README's k, T and k=200 claims are checked against this record
DEFAULT_RUN = "default-2026-12-06-epyc-bf16"


def test_readme__results_table_matches_the_metrics():
    rows = {r[0]: r[1:] for r in table_rows(readme_section("Results (Fashion-MNIST, 2-core CPU)"))}

    def pct(cell: str) -> float | None:
        m = re.search(r"([\d.]+) %", cell)
        return float(m.group(1)) if m else None

    def label(prefix: str) -> str:
        (hit,) = [k for k in rows if k.startswith(prefix)]
        return hit

    def row(prefix: str) -> list[str]:
        return rows[label(prefix)]

    def disagreements(m: dict[str, dict]) -> list[str]:
        base, knn, lin = m["baselines"], m["knn"], m["linear"]
        default = row("MoCo, default")
        claims = {
            "default kNN / linear": ((pct(default[0]), pct(default[1])),
                                     (knn.get("top1"), lin.get("top1"))),
            "pixels tuned kNN": (pct(row("raw pixels, kNN, k and T chosen")[0]),
                                 base.get("pixels_knn")),
            "pixels linear": (pct(row("raw pixels, linear probe")[1]), base.get("pixels_linear")),
            "random-init kNN": (pct(row("random-init encoder")[0]), base.get("random_knn")),
        }
        return [f"{k}: README {a} vs metrics {b}" for k, (a, b) in claims.items() if a != b]

    # metrics/ in the workspace or as committed (a rerun with other params changes the former)
    found = [disagreements(m) for m in _metrics_sets()]
    assert [] in found, dict(zip(("metrics/ in the workspace", "metrics/ as committed"), found))
    rec = {n: _json(f"results/fashion-mnist-{DEFAULT_RUN}/metrics/{n}.json")
           for n in ("baselines", "knn", "linear")}
    # ... of the same run: the numbers both hold agree
    same = [(m["knn"].get("top1"), m["linear"].get("top1"), m["baselines"].get("pixels_knn"))
            for m in _metrics_sets()]
    assert (rec["knn"]["top1"], rec["linear"]["top1"],
            rec["baselines"]["raw_pixels_knn_tuned_top1"]) in same, same
    assert pct(row("raw pixels, kNN k=200")[0]) == rec["baselines"]["raw_pixels_top1"]
    b = rec["baselines"]
    tuned = f"k={b['raw_pixels_knn_tuned_k']}, T={b['raw_pixels_knn_tuned_T']}"
    assert tuned in label("raw pixels, kNN, k and T chosen"), tuned
    for prefix, run in (("MoCo, default", DEFAULT_RUN),
                        ("MoCo, the same encoder at *layer 4*", "default-2026-12-03-epyc"),
                        ("MoCo, `configs/fashion-mnist-long.yaml`", "long"),
                        ("MoCo, the same long encoder at *layer 4*", "long/same-encoder-layer4")):
        cells = row(prefix)
        knn, lin = (_json(f"results/fashion-mnist-{run}/metrics/{m}.json")
                    for m in ("knn", "linear"))
        assert (pct(cells[0]), pct(cells[1])) == (knn["top1"], lin["top1"]), prefix
        assert f"k={knn['k']}, T={knn['T']}" in cells[0], prefix
        assert cells[2] == f"{knn['protocol_top1']} / {lin['protocol_top1']} %", prefix


# --- the map of where things live, and links -------------------------------------------------


def test_readme__map_paths_and_names_exist():
    rows = table_rows(readme_section("Where things live"))
    assert len(rows) >= 11
    for concept, where in rows:
        paths = re.findall(r"`([\w./]+/[\w./]*)`", where)
        assert paths, concept
        for p in paths:
            assert (REPO / p).exists(), f"{concept}: {p}"
        for name in re.findall(r"\(`([\w.]+)`\)", where):
            cls, _, meth = name.partition(".")
            src = (REPO / paths[0]).read_text()
            assert re.search(rf"^(class|def) {cls}\b", src, re.M), f"{paths[0]}: {cls}"
            if meth:
                assert re.search(rf"^    def {meth}\(", src, re.M), f"{paths[0]}: {name}"


LINK = re.compile(r"\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_docs__relative_links_resolve(doc):
    for target in LINK.findall(doc.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        assert dest.exists(), f"{doc.name}: {target}"
        if anchor:
            heads = re.findall(r"^#+ (.*)$", dest.read_text(), re.M)
            assert anchor in {_slug(h) for h in heads}, f"{doc.name}: {target}"


def test_readme__size():
    assert (REPO / "README.md").stat().st_size <= 15_000
