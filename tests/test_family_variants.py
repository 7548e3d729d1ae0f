"""Config variants that real checkpoints use, per family: the walked model computes what transformers computes
for the same weights, and a padded row equals the same row alone (the server batches mixed lengths).

Each case saves a seeded tiny checkpoint with transformers (hidden 32, a few layers), walks it as an export
does, and compares the walked model with transformers' own ``from_pretrained`` of that checkpoint (its
default attention, not the export's eager one) over the real tokens of a right-padded batch whose longest row
is past ModernBERT's local window.  The exported graphs are held to the walked model by the export's own
validation (``tests/test_export_families.py``); this file holds the walked model to transformers.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import CONFIG_MAPPING, AutoModel

from nexus_sli.exporter.errors import CheckpointError, UnsupportedModelError
from nexus_sli.exporter.export.checkpoint import Checkpoint
from nexus_sli.exporter.export.families import FAMILIES
from nexus_sli.exporter.export.families.gte_model import GteSettings
from nexus_sli.exporter.export.source import load_config
from nexus_sli.exporter.export.walk import walk
from nexus_sli.tasks import get_task
from helpers.checkpoints import edit_weights
from helpers.tiny_models import COMMON, TINY_CONFIGS, VOCAB

#: the export's fp32 bar (validate.THRESHOLDS) is 1e-4; a walk that loads the same weights into the same
#: layers differs from transformers by rounding alone
ATOL = 1e-5
LENGTHS, WIDTH = [23, 9, 3], 23

ROBERTA_IDS = {"pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2, "max_position_embeddings": 130}
MODERNBERT_IDS = {"bos_token_id": 2, "eos_token_id": 3, "cls_token_id": 2, "sep_token_id": 3}
DISTILBERT = {"dim": 32, "n_layers": 2, "n_heads": 4, "hidden_dim": 64}
DEBERTA_V3 = {"type_vocab_size": 0, "relative_attention": True, "position_buckets": 32, "pos_att_type": ["c2p", "p2c"],
              "norm_rel_ebd": "layer_norm", "share_att_key": True, "position_biased_input": False}

#: (model_type, architecture saved, config overrides)
VARIANTS = [
    # transformers 5 computes absolute positions whatever this says (it has no relative-key attention left)
    ("bert", "BertModel", {"position_embedding_type": "relative_key"}),
    ("bert", "BertModel", {"position_embedding_type": "relative_key_query"}),
    ("bert", "BertModel", {"type_vocab_size": 1}),
    ("bert", "BertModel", {"hidden_act": "gelu_new", "layer_norm_eps": 1e-7}),
    ("bert", "BertModel", {"hidden_act": "gelu_pytorch_tanh"}),
    ("roberta", "RobertaModel", {**ROBERTA_IDS, "type_vocab_size": 1}),
    ("xlm-roberta", "XLMRobertaModel", ROBERTA_IDS),
    ("camembert", "CamembertModel", ROBERTA_IDS),
    ("electra", "ElectraModel", {"embedding_size": 16}),
    ("albert", "AlbertModel", {"embedding_size": 16, "num_hidden_layers": 3}),
    ("albert", "AlbertModel", {"embedding_size": 16, "num_hidden_layers": 6, "num_hidden_groups": 3}),
    ("albert", "AlbertModel", {"embedding_size": 16, "num_hidden_layers": 5, "num_hidden_groups": 2}),
    ("albert", "AlbertModel", {"embedding_size": 16, "num_hidden_layers": 4, "num_hidden_groups": 2,
                               "inner_group_num": 2, "hidden_act": "gelu_new"}),
    ("distilbert", "DistilBertModel", {**DISTILBERT, "sinusoidal_pos_embds": True}),
    ("distilbert", "DistilBertModel", {**DISTILBERT, "activation": "relu"}),
    ("deberta", "DebertaModel", {"type_vocab_size": 0}),
    ("deberta", "DebertaModel", {"type_vocab_size": 2, "relative_attention": True, "pos_att_type": ["c2p", "p2c"],
                                 "position_biased_input": False}),
    ("deberta", "DebertaModel", {"type_vocab_size": 0, "relative_attention": True, "max_relative_positions": 8,
                                 "pos_att_type": ["p2c"]}),
    ("deberta-v2", "DebertaV2Model", DEBERTA_V3),
    ("deberta-v2", "DebertaV2Model", {**DEBERTA_V3, "embedding_size": 16}),
    ("deberta-v2", "DebertaV2Model", {**DEBERTA_V3, "position_buckets": 8, "pos_att_type": ["p2c", "c2p"],
                                      "conv_kernel_size": 3, "conv_act": "gelu"}),
    ("deberta-v2", "DebertaV2Model", {"type_vocab_size": 0, "relative_attention": True, "position_buckets": -1,
                                      "max_relative_positions": -1, "pos_att_type": ["c2p", "p2c"],
                                      "share_att_key": False, "position_biased_input": True}),
    ("modernbert", "ModernBertModel", {**MODERNBERT_IDS, "num_hidden_layers": 3, "global_attn_every_n_layers": 2,
                                       "local_attention": 8}),
    ("modernbert", "ModernBertModel", {**MODERNBERT_IDS, "num_hidden_layers": 3, "global_attn_every_n_layers": 3,
                                       "local_attention": 4, "hidden_activation": "gelu_pytorch_tanh"}),
    ("mpnet", "MPNetModel", ROBERTA_IDS),
    ("nomic_bert", "NomicBertModel", {}),
    ("roformer", "RoFormerModel", {"embedding_size": 16, "rotary_value": True}),
]


def _perturbed(model: torch.nn.Module) -> torch.nn.Module:
    """Gains and biases moved off their initial ones and zeros, so that a norm or bias the walk dropped or
    misplaced changes the output."""
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 1:
                parameter.add_(0.1 * torch.randn_like(parameter))
    return model


def _save(model: torch.nn.Module, directory):
    _perturbed(model).eval().save_pretrained(directory, safe_serialization=True)
    return directory


def _build(model_type: str, architecture: str, overrides: dict, directory):
    config = CONFIG_MAPPING[model_type](**{**COMMON, **overrides})
    config.architectures = [architecture]
    torch.manual_seed(0)
    return _save(getattr(transformers, architecture)(config), directory)


def _walked(directory, task: str = "embedding"):
    with Checkpoint(directory) as checkpoint:
        model, _, _ = walk(load_config(directory), checkpoint, get_task(task))
    return model


def _padded_batch(pad_id: int):
    ids = torch.randint(5, VOCAB, (len(LENGTHS), WIDTH), generator=torch.Generator().manual_seed(3))
    mask = torch.zeros_like(ids)
    for row, n in enumerate(LENGTHS):
        mask[row, :n] = 1
        ids[row, n:] = pad_id
    return ids, mask


def _real_token_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return max((a[row, :n] - b[row, :n]).abs().max().item() for row, n in enumerate(LENGTHS))


def _states(model, ids, mask) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).last_hidden_state


def _assert_padding_invariant(model, ids, mask, batched: torch.Tensor) -> None:
    for row, n in enumerate(LENGTHS):
        alone = _states(model, ids[row : row + 1, :n], mask[row : row + 1, :n])
        torch.testing.assert_close(batched[row, :n], alone[0], atol=ATOL, rtol=0)


#: every family's tiny model as the export tests build it, then the variants above
ALL_CASES = [(t, architecture, overrides) for t, (architecture, overrides) in sorted(TINY_CONFIGS.items())] + VARIANTS


@pytest.mark.parametrize("model_type, architecture, overrides", ALL_CASES,
                         ids=[f"{t}-{i}" for i, (t, _, _) in enumerate(ALL_CASES)])
def test_walked_variant_matches_transformers_and_ignores_padding(model_type, architecture, overrides, tmp_path):
    directory = _build(model_type, architecture, overrides, tmp_path)
    reference = AutoModel.from_pretrained(directory).eval()
    model = _walked(directory)
    ids, mask = _padded_batch(getattr(reference.config, "pad_token_id", None) or 0)
    walked = _states(model, ids, mask)
    assert _real_token_diff(walked, _states(reference, ids, mask)) <= ATOL
    _assert_padding_invariant(model, ids, mask, walked)


def test_relative_key_checkpoint_from_transformers_4_is_refused_naming_its_tensor(tmp_path):
    """transformers 4 saved a ``distance_embedding`` per layer for relative-key positions; transformers 5 has
    no such attention, so the walk refuses the tensor by name instead of dropping it (and the positions)."""
    directory = _build("bert", "BertModel", {"position_embedding_type": "relative_key"}, tmp_path)
    name = "encoder.layer.0.attention.self.distance_embedding.weight"
    edit_weights(directory, lambda tensors: tensors.update({name: torch.zeros(2 * 128 - 1, 8)}))
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        _walked(directory)


# -- GTE as transformers 5 saves it -----------------------------------------------------------------------
# transformers' own GteConfig (``model_type: gte``) saves the published new-impl weight names but keeps the
# rotary base in ``rope_parameters`` (``rope_type: default``, base 160000 unless set), not in ``rope_theta``.

def _native_gte(directory, architecture: str, **overrides):
    config = transformers.GteConfig(**{**COMMON, "num_labels": 3, **overrides})
    config.architectures = [architecture]
    torch.manual_seed(0)
    return _save(getattr(transformers, architecture)(config), directory)


@pytest.mark.parametrize("overrides", [{}, {"type_vocab_size": 0, "rope_parameters": {"rope_type": "default",
                                                                                        "rope_theta": 20000.0}}])
def test_gte_saved_by_transformers_walks_to_what_transformers_computes(overrides, tmp_path):
    directory = _native_gte(tmp_path, "GteModel", **overrides)
    config = load_config(directory)
    assert config.model_type == "gte" and not hasattr(config, "rope_theta")
    settings = GteSettings.from_config(config)
    assert settings.rope_theta == config.rope_parameters["rope_theta"] and settings.ntk_factor == 1.0
    reference = transformers.GteModel.from_pretrained(directory).eval()
    model = _walked(directory)
    ids, mask = _padded_batch(0)
    walked = _states(model, ids, mask)
    assert _real_token_diff(walked, _states(reference, ids, mask)) <= ATOL
    _assert_padding_invariant(model, ids, mask, walked)


def test_gte_classifier_saved_by_transformers_gives_its_logits(tmp_path):
    directory = _native_gte(tmp_path, "GteForSequenceClassification")
    reference = transformers.GteForSequenceClassification.from_pretrained(directory).eval()
    model = _walked(directory, "classification")
    ids, mask = _padded_batch(0)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).logits,
                                   reference(input_ids=ids, attention_mask=mask).logits, atol=ATOL, rtol=0)


def test_gte_rope_parameters_other_than_default_or_ntk_are_refused():
    config = transformers.GteConfig(**COMMON, rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                                "rope_theta": 10000.0})
    with pytest.raises(UnsupportedModelError, match="rope_scaling type 'linear'"):
        FAMILIES["gte"].create_layer(config, 0)


# -- the project's own layers --------------------------------------------------------------------------------

@pytest.mark.parametrize("model_type, overrides", [
    ("jinabert", {}), ("jinabert", {"num_attention_heads": 2, "feed_forward_type": "original", "hidden_act": "gelu_new"}),
    ("neobert", {}), ("gte", {}), ("gte", {"type_vocab_size": 1, "rope_scaling": {"factor": 4.0, "type": "ntk",
                                                                                  "mixed_b": 1.5}}),
])
def test_project_layers_ignore_padding(model_type, overrides, tiny_tokenizer, tmp_path):
    from helpers.tiny_remote_models import build_tiny_remote

    model = _walked(build_tiny_remote(model_type, tmp_path, tiny_tokenizer, **overrides))
    ids, mask = _padded_batch(0)
    _assert_padding_invariant(model, ids, mask, _states(model, ids, mask))


# -- Nomic's original config keys --------------------------------------------------------------------------
# Nomic's published configs (remote-code era) say n_embd, n_layer, n_head, n_inner, layer_norm_epsilon and
# rotary_emb_base; transformers' NomicBertConfig reads none of them and shows its defaults instead (hidden 768,
# 12 layers and heads, eps 1e-12, rotary base 1000).  A checkpoint of those sizes with another base or eps
# would load into the defaults without a shape error.

NOMIC_ORIGINAL = {"activation_function": "swiglu", "architectures": ["NomicBertModel"], "model_type": "nomic_bert",
                  "n_embd": 32, "n_head": 4, "n_inner": 64, "n_layer": 2, "n_positions": 8192,
                  "layer_norm_epsilon": 1e-5, "rotary_emb_base": 10000, "rotary_emb_fraction": 1.0,
                  "rotary_emb_interleaved": False, "rotary_scaling_factor": None, "qkv_proj_bias": False,
                  "mlp_fc1_bias": False, "mlp_fc2_bias": False, "prenorm": False, "parallel_block": False,
                  "use_rms_norm": False, "causal": False, "type_vocab_size": 2, "vocab_size": VOCAB,
                  "pad_token_id": 0}


def _nomic_with_original_config(directory, **changes):
    """A NomicBertModel of NOMIC_ORIGINAL's sizes, saved with its config rewritten in Nomic's original keys."""
    import json

    native = transformers.NomicBertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        layer_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    torch.manual_seed(0)
    reference = transformers.NomicBertModel(native)
    _save(reference, directory)
    (directory / "config.json").write_text(json.dumps({**NOMIC_ORIGINAL, **changes}))
    return reference.eval()


def test_nomic_original_config_walks_to_the_model_its_keys_describe(tmp_path):
    reference = _nomic_with_original_config(tmp_path)
    config = load_config(tmp_path)
    family = FAMILIES["nomic_bert"]
    assert (family.hidden_size(config), family.num_layers(config), family.num_heads(config),
            family.ffn_width(config)) == (32, 2, 4, 64)
    model = _walked(tmp_path)
    assert model.config.rope_parameters["rope_theta"] == 10000.0 and model.config.layer_norm_eps == 1e-5
    assert config.hidden_size == 768, "the walk adapts its own copy of the config, not the caller's"
    ids, mask = _padded_batch(0)
    walked = _states(model, ids, mask)
    assert _real_token_diff(walked, _states(reference, ids, mask)) <= ATOL
    _assert_padding_invariant(model, ids, mask, walked)


@pytest.mark.parametrize("key, value", [("rotary_emb_fraction", 0.5), ("rotary_emb_interleaved", True),
                                        ("rotary_scaling_factor", 2.0), ("prenorm", True),
                                        ("activation_function", "gelu")])
def test_nomic_original_switches_transformers_does_not_compute_are_refused_by_name(key, value, tmp_path):
    _nomic_with_original_config(tmp_path, **{key: value})
    with pytest.raises(UnsupportedModelError, match=key):
        _walked(tmp_path)
