# Set-up is part of each target: a fresh clone needs only `make demo` or `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test lint

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# The CPU build of torch first: an unpinned torch would pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $@

# The shipped trained model (docs/trained_model.md) continues a Python function.
demo: $(VENV)/.installed
	$(BIN)/dsaserve generate --prompt "$$(printf 'class Cache:\n    """A mapping with a size limit."""\n\n    def __init__(self, maxsize):\n')" --max-tokens 64 --report-timing

test: $(VENV)/.installed
	$(BIN)/pytest -q

lint: $(VENV)/.installed
	$(BIN)/ruff check dsaserve tests benchmarks
