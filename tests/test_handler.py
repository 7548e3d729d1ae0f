"""The seed's BERTFamilyHandler / registry contract."""

from __future__ import annotations

import pytest
from transformers import AlbertConfig, BertConfig, RobertaConfig

from nexus_sli.exporter import BERTFamilyHandler, get_registry
from nexus_sli.exporter.errors import (
    LayerIndexError,
    LayerTypeError,
    NexusError,
    NotYetImplementedError,
    UnsupportedModelError,
)

SEED_TYPES = ["bert", "roberta", "deberta", "deberta_v2", "distilbert", "albert", "modernbert", "jinabert",
              "nomic_bert", "neobert", "electra", "xlm_roberta", "camembert"]
#: registered beyond the seed's list (all-mpnet-base-v2's family, and other encoders transformers or their
#: published code define)
ADDED_TYPES = ["mpnet", "gte", "eurobert", "ernie", "megatron_bert", "roformer", "mobilebert", "xlm_roberta_xl",
               "data2vec_text"]
TINY = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=64, vocab_size=100)


def test_attributes():
    handler = BERTFamilyHandler()
    assert handler.family_id == "bert"
    assert handler.family_name == "BERT-Based Encoder Architectures"
    assert sorted(handler.model_types) == sorted(SEED_TYPES + ADDED_TYPES)
    assert len(handler.architectures) >= 20
    assert {"BertModel", "RobertaForSequenceClassification", "NeoBERT", "JinaBertModel"} <= set(handler.architectures)
    assert handler.trust_remote_code is False
    assert handler.is_encoder_only() is True
    assert handler.get_lm_head_name() is None


@pytest.mark.parametrize("model_type", SEED_TYPES + ADDED_TYPES + ["deberta-v2", "xlm-roberta", "DeBERTa-V2"])
def test_matches_both_spellings(model_type):
    assert BERTFamilyHandler().matches(model_type, [])


def test_does_not_match_decoders():
    handler = BERTFamilyHandler()
    assert not handler.matches("llama", ["LlamaForCausalLM"])
    with pytest.raises(UnsupportedModelError, match="supported types: bert, "):
        get_registry().detect_family({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})


def test_seed_prefix_examples():
    handler = BERTFamilyHandler()
    assert handler.get_layer_prefix(0) == "encoder.layer.0."
    assert handler.get_layer_prefix(5) == "encoder.layer.5."
    assert handler.get_embedding_name() == "embeddings"
    layer = handler.create_layer(RobertaConfig(**TINY), 0)
    assert type(layer).__name__ == "RobertaLayer"
    assert handler.get_layer_prefix(0) == "roberta.encoder.layer.0."
    assert handler.get_embedding_name() == "roberta.embeddings"


def test_create_layer_builds_the_family_layer():
    handler = BERTFamilyHandler()
    assert type(handler.create_layer(BertConfig(**TINY), 0, layer_type="encoder")).__name__ == "BertLayer"


@pytest.mark.parametrize(
    "keys, expected",
    [
        (["embeddings.word_embeddings.weight", "encoder.layer.0.output.dense.weight"], "encoder.layer.2."),
        (["bert.embeddings.word_embeddings.weight", "bert.encoder.layer.0.output.dense.weight", "classifier.weight"],
         "bert.encoder.layer.2."),
    ],
)
def test_prefix_comes_from_checkpoint_keys(keys, expected):
    handler = BERTFamilyHandler().bind(BertConfig(**TINY), keys)
    assert handler.get_layer_prefix(2) == expected


def test_distilbert_task_checkpoint_prefix_and_normalized_sizes():
    config = {"model_type": "distilbert", "dim": 48, "n_layers": 3, "vocab_size": 99, "n_heads": 4}
    keys = ["distilbert.transformer.layer.0.ffn.lin1.weight", "distilbert.embeddings.word_embeddings.weight"]
    handler = BERTFamilyHandler().bind(config, keys)
    assert handler.get_layer_prefix(1) == "distilbert.transformer.layer.1."
    assert handler.get_embedding_name() == "distilbert.embeddings"
    assert (handler.get_num_layers(config), handler.get_hidden_size(config), handler.get_vocab_size(config)) == (3, 48, 99)


def test_nomic_original_config_keys():
    config = {"model_type": "nomic_bert", "n_embd": 64, "n_layer": 5, "vocab_size": 30528}
    handler = BERTFamilyHandler()
    assert (handler.get_num_layers(config), handler.get_hidden_size(config)) == (5, 64)


def test_albert_virtual_layers_wrap_onto_shared_weights():
    # 12 passes over 2 groups of 2 inner layers: 24 virtual layers.
    config = AlbertConfig(num_hidden_layers=12, num_hidden_groups=2, inner_group_num=2, **{
        k: v for k, v in TINY.items() if k != "num_hidden_layers"})
    handler = BERTFamilyHandler()
    handler.create_layer(config, 0)
    assert handler.get_layer_prefix(13) == "albert.encoder.albert_layer_groups.1.albert_layers.1."
    assert handler.get_layer_prefix(0) == "albert.encoder.albert_layer_groups.0.albert_layers.0."
    assert handler.get_layer_prefix(11) == "albert.encoder.albert_layer_groups.0.albert_layers.1."
    assert handler.get_layer_prefix(23) == "albert.encoder.albert_layer_groups.1.albert_layers.1."
    with pytest.raises(LayerIndexError, match=r"\[0, 24\)"):
        handler.get_layer_prefix(24)


def test_a_checkpoints_prefix_goes_with_its_config():
    """Bound to a task checkpoint's keys (``bert.``), then asked for another model's layer: not that prefix."""
    handler = BERTFamilyHandler()
    config = BertConfig(**TINY)
    handler.bind(config, ["bert.encoder.layer.0.attention.self.query.weight"])
    handler.create_layer(config, 0)  # the same model: its checkpoint's prefix stays
    assert handler.get_layer_prefix(0) == "bert.encoder.layer.0."
    handler.create_layer(BertConfig(**TINY), 0)
    assert handler.get_layer_prefix(0) == "encoder.layer.0."


def test_a_numpy_integer_is_an_index_and_a_bool_is_not():
    import numpy as np

    handler = BERTFamilyHandler()
    handler.create_layer(BertConfig(**TINY), np.int64(1))
    assert handler.get_layer_prefix(np.int64(1)) == handler.get_layer_prefix(1)
    with pytest.raises(LayerIndexError, match="layer index True is out of range"):
        handler.get_layer_prefix(True)


@pytest.mark.parametrize("bad_index", [-1, 3, 100])
def test_out_of_range_index_is_typed_error(bad_index):
    with pytest.raises(LayerIndexError, match="out of range"):
        BERTFamilyHandler().create_layer(BertConfig(**TINY), bad_index)


def test_non_encoder_layer_type_is_typed_error():
    handler = BERTFamilyHandler()
    with pytest.raises(LayerTypeError, match="encoder-only"):
        handler.get_layer_prefix(0, layer_type="decoder")
    with pytest.raises(LayerTypeError):
        handler.create_layer(BertConfig(**TINY), 0, layer_type="decoder")


def test_errors_share_one_hierarchy():
    for error in (LayerIndexError, LayerTypeError, NotYetImplementedError, UnsupportedModelError):
        assert issubclass(error, NexusError)


def test_jinabert_detected_from_real_config_shape():
    jina = {"model_type": "bert", "architectures": ["JinaBertForMaskedLM"], "position_embedding_type": "alibi",
            "auto_map": {"AutoModel": "jinaai/jina-bert-implementation--modeling_bert.JinaBertModel"}, **TINY}
    handler = get_registry().detect_family(jina)
    assert handler.family.model_type == "jinabert"
    assert handler.get_layer_prefix(1) == "encoder.layer.1."
    layer = handler.create_layer(jina, 0)
    assert type(layer).__name__ == "JinaBertLayer"
    assert "attention.self.query.weight" in dict(layer.named_parameters())
    assert get_registry().detect_family({"model_type": "bert", **TINY}).family.model_type == "bert"


def test_neobert_registered_with_published_prefix():
    config = {"model_type": "neobert", "hidden_size": 32, "num_hidden_layers": 2, "vocab_size": 100, "max_length": 64,
              "num_attention_heads": 4, "intermediate_size": 64}
    handler = get_registry().detect_family(config)
    handler.bind(config, ["model.encoder.weight", "model.transformer_encoder.0.qkv.weight"])
    assert handler.get_layer_prefix(1) == "model.transformer_encoder.1."
    assert handler.get_embedding_name() == "model.encoder"
    layer = handler.create_layer(config, 0)
    assert type(layer).__name__ == "NeoBertEncoderBlock"
    assert {"qkv.weight", "wo.weight", "ffn.w12.weight", "ffn.w3.weight", "attention_norm.weight",
            "ffn_norm.weight"} == set(dict(layer.named_parameters()))
