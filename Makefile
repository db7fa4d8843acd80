# Set-up and entry points.  PYTHON picks the CPython (3.10-3.13, with a shared libpython).
PYTHON ?= python3
VENV ?= .venv/$(shell $(PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])')

.PHONY: serve demo test bench clean

$(VENV)/.installed: pyproject.toml setup.py $(wildcard multipy/*.c multipy/*.h)
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -m pip install --quiet -e ".[test]"
	touch $@

$(VENV)/.installed-serve: $(VENV)/.installed
	$(VENV)/bin/python -m pip install --quiet -e ".[test,serve]"
	touch $@

examples/generated/python_heavy.pt: $(VENV)/.installed examples/generate_examples.py examples/example_models.py
	$(VENV)/bin/python examples/generate_examples.py --models python_heavy examples/generated

# The main command: the example Python-heavy model served with the Open Inference Protocol
# on http://127.0.0.1:8000 until Ctrl-C (options: make serve SERVE_OPTIONS="--port 8001").
serve: $(VENV)/.installed-serve examples/generated/python_heavy.pt
	$(VENV)/bin/multipy serve examples/generated/python_heavy.pt $(SERVE_OPTIONS)

# The same CPU-bound function on N threads in one interpreter vs N interpreters.
demo: $(VENV)/.installed
	$(VENV)/bin/multipy run benchmarks/core.py

$(VENV)/.installed-bench: $(VENV)/.installed
	$(VENV)/bin/python -m pip install --quiet -e ".[test,bench]"
	touch $@

# The original's benchmark on the example packages: table, bench-results/bench.csv and .png.
bench: $(VENV)/.installed-bench
	$(VENV)/bin/multipy bench

# The test suite, run with room for 15 interpreters.
test: $(VENV)/.installed
	$(VENV)/bin/multipy run -m pytest -q

clean:
	rm -rf .venv build multipy/*.so multipy.egg-info
