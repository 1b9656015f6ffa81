# Two commands set up a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.atomc-installed
# The CPU build of torch these machines carry; pinned first so nothing resolves another torch.
TORCH  ?= torch==2.13.0

.PHONY: install demo test families lint golden bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[dev,hf]" "$(TORCH)"
	$(BIN)/python -m pip install -q --only-binary=hivemind hivemind "$(TORCH)"
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(BIN)/python examples/demo.py

test: install lint
	$(BIN)/python -m pytest -q -p no:cacheprovider --durations=15

# the survey of 95 more Hugging Face families through the whole chain (about 50 minutes)
families: install
	$(BIN)/python -m pytest -q -p no:cacheprovider -m families tests/test_families.py

# ruff, pinned in pyproject.toml's dev extra, with the rules chosen there
lint: install
	$(BIN)/ruff check --no-cache .

golden: install
	$(BIN)/python tests/make_golden.py

bench: install
	$(BIN)/python bench/profile_bench.py
	$(BIN)/python bench/partition_bench.py
	$(BIN)/python bench/place_bench.py
	$(BIN)/python bench/layout_bench.py
	$(BIN)/python bench/fidelity_bench.py
	$(BIN)/python bench/swarm_bench.py --part b

clean:
	rm -rf $(VENV) build *.egg-info
