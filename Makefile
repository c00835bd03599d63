# Two commands: `make run` (set up, then generate with the bundled demo model) and
# `make test` (set up, then lint and run the tests). Set-up is idempotent and fast once done.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PROMPT ?= def fibonacci(n):

.PHONY: setup run test lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,ray]'
	@# The C++ CPU kernels compile at first use; do it now, once (a failure only warns).
	$(PY) -c 'from fleetllm.attention.kernel_build import main; main()'
	touch $(STAMP)

run: setup
	$(VENV)/bin/fleetllm generate --max-tokens 64 "$(PROMPT)"

lint: setup
	$(VENV)/bin/ruff check .

# pytest runs in a private network namespace where only loopback exists (Ray and gloo then
# bind 127.0.0.1); where unshare is not permitted it runs plainly.
test: lint
	@if unshare -n true 2>/dev/null; then \
		unshare -n sh -c 'ip link set lo up && exec $(PY) -m pytest -q $(PYTEST_ARGS)'; \
	else \
		$(PY) -m pytest -q $(PYTEST_ARGS); \
	fi

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info build dist
