# Two entry points do all set-up on a fresh machine: `make demo` and `make test`.
# MPI=mpich (default) installs MPICH from PyPI into the venv; MPI=system uses the mpirun on PATH
# (a system Open MPI or a cluster module), with mpi4py loading that library.
PYTHON ?= python3
VENV ?= .venv
MPI ?= mpich
BIN := $(VENV)/bin
PY := $(BIN)/python
ifeq ($(MPI),mpich)
MPIRUN ?= $(abspath $(BIN)/mpirun)
else
MPIRUN ?= $(shell command -v mpirun)
endif
# Harmless for MPICH; lets a system Open MPI run as root, oversubscribed, without busy-waiting (see docs/testing.md).
export OMPI_ALLOW_RUN_AS_ROOT=1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1
export PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe
export OMPI_MCA_mpi_yield_when_idle=1
export OMPI_MCA_hwloc_base_binding_policy=none
export PRTE_MCA_hwloc_default_binding_policy=none
export OMP_NUM_THREADS=1
export DISTSIM_MPIRUN=$(MPIRUN)
DEMO_OUT ?= demo-out
DEMO_RANKS ?= 4

# Run a set-up command without its chatter; on failure show everything it printed.
quietly = out=$$($(1) 2>&1) || { echo "$$out"; exit 1; }

.PHONY: setup demo test lint test-serial test-mpi slurm-deps bench bench-accuracy clean

setup: $(VENV)/.setup-$(MPI)

$(VENV)/.setup-$(MPI): requirements.txt requirements-mpich.txt setup.py pyproject.toml
	@echo "setting up $(VENV): pinned dependencies$(if $(filter mpich,$(MPI)), and MPICH from PyPI), this package (editable)"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(call quietly,$(PY) -m pip install --disable-pip-version-check --upgrade pip)
	@$(call quietly,$(PY) -m pip install --disable-pip-version-check -r requirements.txt)
	@if [ "$(MPI)" = mpich ]; then $(call quietly,$(PY) -m pip install --disable-pip-version-check -r requirements-mpich.txt); fi
	@$(call quietly,$(PY) -m pip install --disable-pip-version-check --no-deps --no-build-isolation -e .)
	@rm -f $(VENV)/.setup-*
	@touch $@

# The main job end to end on the built-in search: the union of its candidates' events, a 4-rank profile (as 2
# emulated nodes of 2, so inter-node pairs are measured too), the ranked search, then the best candidate's
# timeline as a Perfetto trace and a picture.
demo: setup
	$(PY) -m harness events harness/jobs/search.toml
	DISTSIM_EMULATE_RANKS_PER_NODE=2 $(MPIRUN) -n $(DEMO_RANKS) $(PY) -m mpi4py -m harness profile harness/jobs/search.toml -o $(DEMO_OUT)
	$(PY) -m analysis search $(DEMO_OUT)/profile.h5 --top 6 --write-spec $(DEMO_OUT)/best.toml --png $(DEMO_OUT)/search.png
	$(PY) -m analysis simulate $(DEMO_OUT)/profile.h5 --spec $(DEMO_OUT)/best.toml --trace $(DEMO_OUT)/best.json.gz --png $(DEMO_OUT)/best.png --json > $(DEMO_OUT)/best.json
	@echo "more: python -m analysis simulate $(DEMO_OUT)/profile.h5 --spec $(DEMO_OUT)/best.toml --details; python -m harness show $(DEMO_OUT)/profile.h5; python -m analysis network $(DEMO_OUT)/profile.h5 --nodes 1,2,16"

test: setup slurm-deps
	$(MAKE) --no-print-directory lint test-serial test-mpi

# ruff over the whole tree (settings in pyproject.toml).
lint: setup
	$(BIN)/ruff check .

# The tests run more ranks than cores: MPICH's waits then sleep instead of spinning (TEST_MPI_ENV; without it a
# rank waiting in a collective takes a core from the rank it waits for, and the -n 4 pass ran 12-24 minutes).
# Never for profiles or benchmarks: it makes a small all-reduce take 180 us instead of 11 (docs/testing.md).
TEST_MPI_ENV := MPIR_CVAR_ENABLE_HEAVY_YIELD=1

test-serial: setup
	$(TEST_MPI_ENV) $(PY) -m pytest -q tests

test-mpi: setup
	$(TEST_MPI_ENV) $(MPIRUN) -n 2 $(PY) -m mpi4py -m pytest -q --with-mpi -m mpi tests
	$(TEST_MPI_ENV) $(MPIRUN) -n 4 $(PY) -m mpi4py -m pytest -q --with-mpi -m mpi tests

# Debian's Slurm and munge for the Slurm tests; only where we are root and apt exists (tests skip otherwise, fail under CI=true).
slurm-deps:
	@if [ -x tests/slurm/install_slurm.sh ]; then tests/slurm/install_slurm.sh; fi

bench: setup
	$(PY) bench/events_scale.py
	$(PY) bench/simulate_scale.py
	$(PY) bench/profile_scaling.py
	$(PY) bench/machine_noise.py

# Profile, run and validate six configurations four times each (about 12 minutes on 2 cores).
bench-accuracy: setup
	$(PY) bench/accuracy.py

clean:
	rm -rf $(VENV) $(DEMO_OUT) build *.egg-info
