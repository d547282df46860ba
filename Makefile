# `make up`: install what is missing, then run the whole stack on localhost.
# `make test`: install what is missing, then run the whole test suite.

PY := .venv/bin/python
PORT ?= 8000
WORKERS ?= 1

.PHONY: up deps test-deps test test-fast bench lint clean

deps:
	@./scripts/bootstrap.sh

test-deps:
	@./scripts/bootstrap.sh --test

up: deps
	@$(PY) -m launcher.cli up --port $(PORT) --workers $(WORKERS)

# Tests that run a plain `node` get Node.js >= 20 first on PATH: the system's, or the one
# bootstrap.sh put in .tools/node (see launcher/node.py).
WITH_NODE = node=$$($(PY) -m launcher.node) && PATH="$${node%/*}:$$PATH"

test: test-deps
	@$(WITH_NODE) $(PY) -m pytest -q

test-fast: test-deps
	@$(WITH_NODE) $(PY) -m pytest -q -m "not slow"

bench: test-deps
	@$(PY) bench/latency.py
	@$(PY) bench/interactive.py
	@$(PY) bench/ide_browser.py
	@$(PY) bench/parked.py
	@$(PY) bench/streaming.py

lint: test-deps
	@.venv/bin/ruff check .

clean:
	rm -rf .venv .tools realtime/node_modules clients/js/node_modules .pytest_cache
