# nexus-sli: export BERT-family encoders to a Triton model repository.
# `make export` and `make test` install everything they need into .venv first.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin

MODEL     ?=
TASK      ?= embedding
PRECISION ?= fp32
NAME      ?=
OUT       ?= model_repository

.PHONY: install export test clean

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

test: install
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(OUT)/*/ .pytest_cache
