# `make up`: install what is missing, then run the whole stack on localhost.
# `make test`: install what is missing, then run the whole test suite.

PY := .venv/bin/python
# make up PORT=9000, or API_PORT in the environment (as the API itself reads it).
PORT ?= $(or $(API_PORT),8000)
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

# bench/hotpath.py puts every hot-path figure next to Piston when PISTON_URL names one
# (`PISTON_URL=http://127.0.0.1:2000 make bench`), else next to bare nsjail; HOTPATH_ARGS
# passes it options (`make bench HOTPATH_ARGS="--reps 1"`). See bench/README.md.
bench: test-deps
	@$(PY) bench/floor.py
	@$(PY) bench/hotpath.py $(HOTPATH_ARGS)
	@$(PY) bench/grading.py
	@$(PY) bench/parked.py
	@$(PY) bench/interactive.py
	@$(PY) bench/ide_browser.py

lint: test-deps
	@.venv/bin/ruff check .

clean:
	rm -rf .venv .tools realtime/node_modules clients/js/node_modules .pytest_cache
