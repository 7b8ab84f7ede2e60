# ddtree-deploy: everyday commands. `make setup patch` then `make test`.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
CLI := $(VENV)/bin/ddtree-deploy
HOST ?=
TO ?=
PIN ?=
PINOPT := $(if $(PIN),--pin $(PIN),)

.PHONY: refresh setup patch check test test-fast test-gpu series push plan status rollback bench bench-serve clean help

help:
	@echo "make setup      create $(VENV) and install the project, its tests and the SGLang test environment"
	@echo "make patch      build build/sglang-<ver>/ of every pin (snapshot/sglang-<ver>/ + patches/<ver>/series) and run the quality gates"
	@echo "make check      run the quality gates on the current build of every pin"
	@echo "                PIN=<ver> for one pin: make patch PIN=0.5.16, make check|series PIN=..., make refresh PATCH=... [PIN=...]"
	@echo "make test       run the test suite (what CI runs; 9.5 min on a fresh 2-core clone, CPU-bound: docs/TESTING.md; in parallel with pytest-xdist)"
	@echo "make test-fast  the inner loop: everything but the interpreter, statistical, sshd and slow tiers (under 3 min)"
	@echo "make push HOST=ct200 | make plan HOST=ct200 | make status HOST=ct200 | make rollback HOST=ct200 [TO=<release>|pristine]"
	@echo "make bench-serve URL='http://127.0.0.1:30000 ct200' PROMPTS=prompts.jsonl [ARGS='--concurrency 1,4 --plot b.png']"

setup:
	scripts/setup_env.sh $(VENV)

# A fresh checkout has no venv yet: the commands below create it first (`make setup` redoes it).
$(PY):
	scripts/setup_env.sh $(VENV)

patch: $(PY)
	$(CLI) patch $(PINOPT)

check: $(PY)
	$(CLI) check $(PINOPT)

series: $(PY)
	$(CLI) series $(PINOPT)

# Parallel workers (pytest-xdist); each sshd test module starts its own test bed in its worker.
# The tiers (markers in pyproject.toml): interp, stat, ssh, slow run in `test`, not in `test-fast`.
# `test` runs more workers than cores so a worker waiting on an sshd host or a service restart
# leaves the CPU to the others (the suite is CPU-bound on 2 cores: most of its CPU is spent by the
# bed's services and host agents, which /usr/bin/time does not count; docs/TESTING.md, eighth
# session); tests/conftest.py starts the known-long tests first, one per worker. `test-fast` is
# CPU-bound and does not.
WORKERS ?= 4
FAST_WORKERS ?= 2
FAST_TIER := not (interp or stat or ssh or slow or gpu)

# Bytecode of the project's own modules, written once before a run: the tests start the CLI a few
# hundred times, and where the environment sets PYTHONDONTWRITEBYTECODE (as this project's machines
# do) each start would compile deploy/ and checks/ anew (about a third of a start's CPU). Python
# checks each .pyc against its source, so an edited file is compiled afresh; __pycache__ is ignored.
PYC := $(PY) -m compileall -q deploy checks ddtree_budget.py ddtree_reference.py ddtree_serving.py ddtree_triton.py ddtree_utils.py

test: $(PY)
	$(PYC)
	$(PY) -m pytest -q -n $(WORKERS) --dist worksteal tests

test-fast: $(PY)
	$(PYC)
	$(PY) -m pytest -q -n $(FAST_WORKERS) -m "$(FAST_TIER)" tests

test-gpu: $(PY)
	$(PY) -m pytest -q -m gpu tests/gpu

push: $(PY)
	@test -n "$(HOST)" || { echo "usage: make push HOST=<name>" >&2; exit 2; }
	$(CLI) push $(HOST)

plan: $(PY)
	@test -n "$(HOST)" || { echo "usage: make plan HOST=<name>" >&2; exit 2; }
	$(CLI) plan $(HOST)

status: $(PY)
	@test -n "$(HOST)" || { echo "usage: make status HOST=<name>" >&2; exit 2; }
	$(CLI) status $(HOST)

rollback: $(PY)
	@test -n "$(HOST)" || { echo "usage: make rollback HOST=<name> [TO=<release>|pristine]" >&2; exit 2; }
	$(CLI) rollback $(HOST) $(if $(TO),--to $(TO),)

bench: $(PY)
	$(PY) bench/tree_build.py

# Serving benchmark against live servers (URLs or inventory host names): ddtree-deploy bench.
bench-serve: $(PY)
	@test -n "$(URL)" -a -n "$(PROMPTS)" || { echo "usage: make bench-serve URL='<url|host> ...' PROMPTS=<file.jsonl> [ARGS='...']" >&2; exit 2; }
	$(CLI) bench $(URL) --prompts $(PROMPTS) $(ARGS)

clean:
	rm -rf build

refresh: $(PY)
	@test -n "$(PATCH)" || { echo "usage: make refresh PATCH=<NNNN-name.patch> [PIN=<version>]" >&2; exit 2; }
	$(CLI) refresh $(PINOPT) $(PATCH)
