# nexus-sli: export BERT-family encoders to a Triton model repository.
# `make export` and `make test` install everything they need into .venv first.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin

MODEL     ?=
TASK      ?= auto
PRECISION ?= fp32
NAME      ?=
OUT       ?= model_repository
HTTP_PORT ?= 8000
GRPC_PORT ?= 8001
METRICS_PORT ?= 8002

.PHONY: install export serve test clean

install: $(VENV)/.installed

# torch first, pinned to the CPU build this machine kind serves from disk:
# an unpinned torch would pull a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[export,serve,client,test]'
	touch $@

export: install
	$(BIN)/nexus-sli export $(if $(MODEL),--model '$(MODEL)') --task '$(TASK)' \
		--precision '$(PRECISION)' $(if $(NAME),--name '$(NAME)') --out '$(OUT)'

# Exports the default model first when OUT holds no model yet.
serve: install
	@ls '$(OUT)'/*/config.pbtxt >/dev/null 2>&1 || $(MAKE) --no-print-directory export
	$(BIN)/nexus-sli serve --model-repository '$(OUT)' --http-port $(HTTP_PORT) \
		--grpc-port $(GRPC_PORT) --metrics-port $(METRICS_PORT)

test: install
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(OUT)/*/ .pytest_cache
