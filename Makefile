# Two commands on a fresh machine: `make run` (set up + dvc repro) and `make test` (set up + tests).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
export PATH := $(abspath $(BIN)):$(PATH)
FMNIST := /usr/share/datasets/fashion-mnist

.PHONY: setup data run test test-fast lint format ui bench clean-venv

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# torch/torchvision first, pinned to the pair that imports together here (docs/pipeline.md).
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --disable-pip-version-check -q torch==2.14.1 torchvision==0.29.1
	$(BIN)/pip install --disable-pip-version-check -q -e '.[dev]'
	touch $@

# Fashion-MNIST from Debian's dataset-fashion-mnist when apt is available and we are root;
# otherwise the build_shards stage needs data.download: true (torchvision's download).
data:
	@if [ ! -f $(FMNIST)/train-images-idx3-ubyte.gz ]; then \
	  if command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	    (apt-get install -y -q dataset-fashion-mnist || \
	     (apt-get update -q && apt-get install -y -q dataset-fashion-mnist)) >/dev/null; \
	  else echo "note: $(FMNIST) missing and apt unavailable: set data.download: true and data.root: data/raw/fashion-mnist"; fi; \
	fi

setup: $(VENV)/.installed data

# dvc.yaml's first stage (check_params) validates params.yaml before any stage deletes its
# outputs, so a bare `dvc repro` is as safe as `make run`.
run: setup
	dvc repro

# one worker per core, each test file on one worker (its module fixtures, such as an e2e
# module's `dvc repro`, run once), the longest files first (tests/conftest.py)
test: setup
	pytest -q -n auto --dist loadfile --no-loadscope-reorder --durations=15

test-fast: setup
	pytest -q -m "not slow"

lint: setup
	ruff check pipeline stages tests benchmarks

format: setup
	ruff format pipeline stages tests benchmarks

# The MLflow UI on the project's database, bound to localhost only. MLflow 3.17 opens an
# experiment on its GenAI overview unless the URL asks for the model-training view: the line
# printed first is the experiment's runs table (docs/tracking.md).
ui: setup
	@python -c 'from pipeline.tracking import experiment_ui_url; \
	  print("MLflow runs table:", experiment_ui_url("sqlite:///$(CURDIR)/mlflow.db"))'
	mlflow ui --backend-store-uri sqlite:///$(CURDIR)/mlflow.db --host 127.0.0.1 --port 5000

bench: setup
	$(BIN)/pip install --disable-pip-version-check -q -e '.[dev,bench]'
	python benchmarks/run_all.py

clean-venv:
	rm -rf $(VENV)
