# Two commands set up a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.atomc-installed
# The CPU build of torch these machines carry; pinned first so nothing resolves another torch.
TORCH  ?= torch==2.13.0
# timm, for the model-zoo tests, is installed without its dependencies: the zoo extra has
# them but torchvision, whose wheels for this torch are CUDA builds that do not import beside
# the CPU one; the tests import timm through a stand-in (tests/shims/README.md)
TIMM   ?= timm>=1.0.20,<1.1

.PHONY: install demo test test-long families survey lint golden bench tables clean

# pip compiles each package's bytecode on one core as it installs, all of it (about 300 MB of
# sources, 50 s of the 2-core CI machine's time), though a run imports a few thousand files.
# Python compiles those as it first imports them and keeps the bytecode, also where the
# environment says not to write it (PYTHONDONTWRITEBYTECODE, which made every process compile
# torch again: 13 s of imports in place of 5)
export PYTHONDONTWRITEBYTECODE :=

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q --no-compile "$(TORCH)"
	$(BIN)/python -m pip install -q --no-compile --only-binary=hivemind \
		-e ".[dev,hf,zoo,data,peft]" hivemind "$(TORCH)"
	$(BIN)/python -m pip install -q --no-compile --no-deps "$(TIMM)" "$(TORCH)"
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(BIN)/python examples/demo.py

# pytest-xdist workers, one per core of the CI machine; the tests of a module (of a model, in
# tests/test_models.py) share a worker, handed out slow and large groups first (tests/conftest.py)
TEST_WORKERS ?= 2

test: install lint
	$(BIN)/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadgroup \
		--no-loadscope-reorder --durations=15

# the multi-process scenarios past make test's time (SWARM through a kill, 8-bit links over 100
# steps, DiLoCo peers dying and joining, more layouts across processes; about 5 minutes): each
# of their parts has a shorter test in make test; run them before a release
test-long: install
	$(BIN)/python -m pytest -q -p no:cacheprovider -m long -n $(TEST_WORKERS) --dist loadgroup \
		--no-loadscope-reorder

# the survey of 95 more Hugging Face families through the whole chain (about 50 minutes)
families: install
	$(BIN)/python -m pytest -q -p no:cacheprovider -m families tests/test_families.py

# the coverage surveys (bench/survey.py): SUITE=timm|hf|torchvision, one row per model in
# bench/survey/SUITE.csv, then the table of all three in docs/model-files.md (each up to 2
# hours; not part of make test). torchvision imports only beside the CUDA torch it was built
# for, so its suite runs in a virtual environment of its own, never in .venv
SUITE    ?= timm
TV_VENV  ?= .venv-tv
TV_STAMP := $(TV_VENV)/.atomc-installed
TV_TORCH ?= torch==2.14.1 torchvision==0.29.1

$(TV_STAMP): pyproject.toml
	$(PYTHON) -m venv $(TV_VENV)
	$(TV_VENV)/bin/python -m pip install -q -e ".[dev]" $(TV_TORCH)
	touch $(TV_STAMP)

survey: install
ifeq ($(SUITE),torchvision)
	$(MAKE) $(TV_STAMP)
	$(TV_VENV)/bin/python bench/survey.py --suite torchvision
else
	$(BIN)/python bench/survey.py --suite $(SUITE)
endif
	$(BIN)/python bench/survey.py --summary

# ruff, pinned in pyproject.toml's dev extra, with the rules chosen there
lint: install
	$(BIN)/ruff check --no-cache .

golden: install
	$(BIN)/python tests/make_golden.py

# docs/gpt3-plans.md: every GPT-3 table row planned by the real command (several minutes)
tables: install
	$(BIN)/python bench/gpt3_tables.py
	$(BIN)/python bench/host_tables.py

bench: install
	$(BIN)/python bench/profile_bench.py
	$(BIN)/python bench/partition_bench.py
	$(BIN)/python bench/place_bench.py
	$(BIN)/python bench/layout_bench.py
	$(BIN)/python bench/fidelity_bench.py
	$(BIN)/python bench/swarm_bench.py --part b

clean:
	rm -rf $(VENV) $(TV_VENV) build *.egg-info
