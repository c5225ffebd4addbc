# `make demo` and `make test` set up .venv themselves on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-fast test-lowest test-gpu-image lint bench check-wheel
setup: $(STAMP)

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	# The CPU build of torch must come first: any other torch spec pulls GBs of CUDA wheels.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,megatron,ray,remote]'
	# SGLang's own ServerArgs for the sglang-offline tests: the package without its dependencies (they would
	# replace torch), plus the few its settings module imports.
	$(PY) -m pip install -q --no-deps sglang==0.5.23
	$(PY) -m pip install -q orjson==3.13.0 pybase64==1.5.1 triton==3.9.0 starlette==1.10.0 msgspec==0.22.0 aiohttp==3.14.5
	touch $(STAMP)

demo: setup
	$(VENV)/bin/probe demo --out demo-run

# Two pytest-xdist workers, whole files to each (module fixtures built once), one torch thread each
# (tests/conftest.py): the tiny test models gain nothing from a second thread (docs/development.md).
PYTEST := $(PY) -m pytest -q -n 2 --dist loadfile

test: setup
	$(PYTEST)

# Everything but the tests marked slow (whole engines end to end, the demo, kills and resumes): a quick lane.
test-fast: setup
	$(PYTEST) -m "not slow"

# The declared dependency ranges, each lane in its own virtualenv (scripts/lane.sh): every direct dependency at
# the floor pyproject.toml declares (.venv-lowest), and the versions of our users' GPU image (.venv-gpu-image,
# pins in scripts/lanes/gpu-image.txt). Each: install, `probe --help` and `probe env`, the lane subset
# (`pytest -m lane`).
test-lowest:
	scripts/lane.sh lowest

test-gpu-image:
	scripts/lane.sh gpu-image

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench: setup
	$(PY) benchmarks/bench_report.py

# The built wheel in a fresh virtualenv outside the checkout, with and without [megatron].
check-wheel:
	scripts/check_wheel.sh
