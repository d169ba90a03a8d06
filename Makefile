# The README's two commands are `make demo` and `make test`; both set up .venv first.
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup demo test diagrams bench

setup:
	bash scripts/setup.sh

demo: setup
	$(BIN)/decodespec generate "Once upon a time" --stop "." --max-tokens 48

test: setup
	$(BIN)/pytest -n 2 -q

diagrams: setup
	$(BIN)/decodespec diagrams

bench: setup
	$(BIN)/python benchmarks/bench_stepper.py
