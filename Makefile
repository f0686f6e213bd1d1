# The two commands a new user runs: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PROTO_FILES := $(wildcard proto/kvplane/v1/*.proto)

.PHONY: demo test lint typecheck unit proto bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

## Smoke run of the control plane: start it, push events through real gRPC, query it.
demo: $(STAMP)
	$(BIN)/kvplane demo

## The whole suite: format, lint, types, then the tests (real Redis, real gRPC).
test: $(STAMP) lint typecheck unit

lint: $(STAMP)
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .

typecheck: $(STAMP)
	$(BIN)/mypy

unit: $(STAMP)
	$(BIN)/pytest -q

## Regenerate the gRPC stubs from proto/ (the tests fail when they are stale).
proto: $(STAMP)
	$(BIN)/python -m grpc_tools.protoc -Iproto --python_out=. --grpc_python_out=. --pyi_out=. $(PROTO_FILES)

## Benchmarks: print their figures and write bench-index.json, bench-engine-sim.json, bench-agent.json.
bench: $(STAMP)
	$(BIN)/kvplane bench index --json bench-index.json
	$(BIN)/kvplane bench engine-sim --json bench-engine-sim.json
	$(BIN)/kvplane bench agent --json bench-agent.json

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
