# Two commands: `make run` (set up, then generate with the bundled demo model) and
# `make test` (set up, then lint, build the docs and run the tests). Set-up is idempotent and
# fast once done.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PROMPT ?= def fibonacci(n):

# docs is also a directory: without .PHONY, make would take the target as built and skip it.
.PHONY: setup run test lint docs clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,ray,docs]'
	touch $(STAMP)

run: setup
	$(VENV)/bin/fleetllm generate --max-tokens 64 "$(PROMPT)"

lint: setup
	$(VENV)/bin/ruff check .

# The docs site (mkdocs.yml) into site/ (ignored). --strict: a broken link or anchor fails the
# build, and so `make test`. Nothing is fetched. NO_MKDOCS_2_WARNING: mkdocs-material's banner.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

# pytest runs in a private network namespace where only loopback exists (Ray and gloo then
# bind 127.0.0.1); where unshare is not permitted it runs plainly.
test: lint docs
	@if unshare -n true 2>/dev/null; then \
		unshare -n sh -c 'ip link set lo up && exec $(PY) -m pytest -q $(PYTEST_ARGS)'; \
	else \
		$(PY) -m pytest -q $(PYTEST_ARGS); \
	fi

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info build dist site
