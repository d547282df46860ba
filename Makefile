# `make up`: install what is missing, then run the whole stack on localhost.
# `make test`: install what is missing, then run the whole test suite.

PY := .venv/bin/python
PORT ?= 8000

.PHONY: up deps test-deps test test-fast bench lint clean

deps:
	@./scripts/bootstrap.sh

test-deps:
	@./scripts/bootstrap.sh --test

up: deps
	@$(PY) -m launcher.cli up --port $(PORT)

test: test-deps
	@$(PY) -m pytest -q

test-fast: test-deps
	@$(PY) -m pytest -q -m "not slow"

bench: test-deps
	@$(PY) bench/latency.py

lint: test-deps
	@.venv/bin/ruff check .

clean:
	rm -rf .venv .tools realtime/node_modules clients/js/node_modules .pytest_cache
