# `make demo` and `make test` each set up .venv on a fresh machine, then run.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test gpu-test proto-check clean

$(STAMP): setup.py pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider --timeout=600 -n auto tests

# the goldens must run there, not skip: point CAFFE_SYNCBN_SHARED at a copy of ../shared
gpu-test:
	CAFFE_SYNCBN_REQUIRE_DATA=1 PYTHONPATH=. python3 -m pytest -q -m gpu --timeout=900 tests

proto-check: $(STAMP)
	$(PY) tools/gen_proto.py --check

clean:
	rm -rf $(VENV) build *.egg-info
