from __future__ import annotations

import pytest

from nexus_sli.exporter.export.layer_cache import CACHE_DIR_ENV
from nexus_sli.exporter.export.validate import validation_texts
from tiny_models import build_tiny, train_tokenizer


@pytest.fixture(scope="session", autouse=True)
def scratch_layer_cache(tmp_path_factory):
    """Exports cache layers by default: keep every test (and its subprocesses) out of the user's cache."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CACHE_DIR_ENV, str(tmp_path_factory.mktemp("layer-cache")))
        yield


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return train_tokenizer(validation_texts())


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory, tiny_tokenizer):
    """``tiny_checkpoint("roberta")`` -> directory of a seeded tiny checkpoint (built once)."""
    built = {}

    def make(model_type: str):
        if model_type not in built:
            built[model_type] = build_tiny(model_type, tmp_path_factory.mktemp(model_type), tiny_tokenizer)
        return built[model_type]

    return make
