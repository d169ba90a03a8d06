# The README's two commands are `make demo` and `make test`; both set up .venv first.
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup demo lint test diagrams bench

setup:
	bash scripts/setup.sh

demo: setup
	$(BIN)/decodespec generate "Once upon a time" --stop "." --max-tokens 48

# ruff and mypy under pyproject.toml's [tool.ruff] and [tool.mypy]; both must report nothing.
lint: setup
	$(BIN)/ruff check .
	$(BIN)/python scripts/typecheck.py

test: lint
	$(BIN)/pytest -n 2 -q

diagrams: setup
	$(BIN)/decodespec diagrams

bench: setup
	$(BIN)/python benchmarks/bench_stepper.py
