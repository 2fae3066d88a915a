# Two entry points, each self-sufficient on a fresh machine with Python >= 3.11:
#   make run   - the main job: on the GPU / TPU when JAX finds one (docs/running.md), else the CPU default
#   make test  - the test suite (always on the CPU: it is written for the 8 faked CPU devices)
# Both create (or reuse) the local virtual environment .venv and install the package into it.

PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed
# the simulator's compiled event core (setup.py), rebuilt when its source changes
CORE := $(VENV)/.sim_core
# Faked devices for the CPU default and the sharding tests (the flag concerns the CPU platform only: on a
# GPU or TPU it does nothing); a persistent compile cache halves warm compiles. JAX_PLATFORMS is left to
# the user: unset, JAX takes the accelerator when there is one (tiderl_jax/config.py, apply_platform_settings).
export XLA_FLAGS ?= --xla_force_host_platform_device_count=8
export JAX_COMPILATION_CACHE_DIR ?= $(CURDIR)/.jax_cache
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS ?= 0
export JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES ?= 0

.PHONY: run test venv clean

$(STAMP): pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	TIDERL_NO_EXTENSIONS=1 $(VENV)/bin/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

$(CORE): $(STAMP) tiderl_jax/sim/kv.py tiderl_jax/sim/kv.pxd tiderl_jax/sim/replicas.py tiderl_jax/sim/replicas.pxd
	$(VENV)/bin/python -m pip install --quiet --no-deps -e .
	touch $(CORE)

venv: $(CORE)

run: $(CORE)
	$(VENV)/bin/python launch/train.py --config=configs/tiny_agentic.py $(ARGS)

# The suite runs in two pytest processes (test files a-m, then the rest; exit status 5, "no test selected" by ARGS,
# counts as a pass): one process segfaulted inside XLA at the same point of three cold-cache runs, 97% in
# (tests/test_visual.py compiling in the engine's worker thread), while those tests pass in smaller groups.
TESTS_A := $(wildcard tests/test_[a-m]*.py)
TESTS_B := $(filter-out $(TESTS_A),$(wildcard tests/test_*.py))
test: $(CORE)
	JAX_PLATFORMS=cpu $(VENV)/bin/python -m pytest -q $(TESTS_A) $(ARGS); s=$$?; [ $$s -eq 0 ] || [ $$s -eq 5 ] || exit $$s
	JAX_PLATFORMS=cpu $(VENV)/bin/python -m pytest -q $(TESTS_B) $(ARGS); s=$$?; [ $$s -eq 0 ] || [ $$s -eq 5 ] || exit $$s

clean:
	rm -rf $(VENV) .jax_cache
