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

test: $(CORE)
	JAX_PLATFORMS=cpu $(VENV)/bin/python -m pytest -q tests $(ARGS)

clean:
	rm -rf $(VENV) .jax_cache
