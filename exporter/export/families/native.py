"""The families transformers implements natively.

Layer classes are referenced by name under ``transformers.models``; the rest
of each family is its prefixes and config keys.  Weight names were read off
``AutoModel.from_config`` for each type (transformers 5.x).
"""

from __future__ import annotations

from typing import Any, ClassVar

from nexus_sli.exporter.errors import UnsupportedModelError

from .base import EncoderFamily, config_value, register

_TASK_SUFFIXES = ("Model", "ForMaskedLM", "ForSequenceClassification", "ForTokenClassification",
                  "ForQuestionAnswering", "ForMultipleChoice")


def _archs(stem: str, *extra: str) -> tuple[str, ...]:
    return tuple(stem + suffix for suffix in (*_TASK_SUFFIXES, *extra))


@register
class BertFamily(EncoderFamily):
    model_type = "bert"
    architectures = _archs("Bert", "ForPreTraining", "ForNextSentencePrediction")
    base_prefix = "bert"
    layer_class = "bert.modeling_bert:BertLayer"
    layer_takes_index = True
    pretraining_head_prefixes = ("cls.",)
    masked_lm = True


@register
class ElectraFamily(BertFamily):
    model_type = "electra"
    architectures = _archs("Electra", "ForPreTraining")
    base_prefix = "electra"
    default_prefix = "electra."
    layer_class = "electra.modeling_electra:ElectraLayer"
    pretraining_head_prefixes = ("discriminator_predictions.", "generator_predictions.", "generator_lm_head.")
    masked_lm = False


@register
class RobertaFamily(BertFamily):
    model_type = "roberta"
    architectures = _archs("Roberta")
    base_prefix = "roberta"
    default_prefix = "roberta."
    layer_class = "roberta.modeling_roberta:RobertaLayer"
    position_offset_from_pad = True
    pretraining_head_prefixes = ("lm_head.",)
    masked_lm = False


@register
class XLMRobertaFamily(RobertaFamily):
    model_type = "xlm_roberta"
    aliases = ("xlm-roberta",)
    architectures = _archs("XLMRoberta")
    layer_class = "xlm_roberta.modeling_xlm_roberta:XLMRobertaLayer"


@register
class XLMRobertaXLFamily(RobertaFamily):
    """XLM-RoBERTa XL and XXL: RoBERTa's positions with pre-norm layers and a final ``encoder.LayerNorm``."""

    model_type = "xlm_roberta_xl"
    aliases = ("xlm-roberta-xl",)
    architectures = _archs("XLMRobertaXL")
    layer_class = "xlm_roberta_xl.modeling_xlm_roberta_xl:XLMRobertaXLLayer"


@register
class Data2VecTextFamily(RobertaFamily):
    model_type = "data2vec_text"
    aliases = ("data2vec-text",)
    architectures = _archs("Data2VecText")
    base_prefix = "data2vec_text"
    default_prefix = "data2vec_text."
    layer_class = "data2vec.modeling_data2vec_text:Data2VecTextLayer"


@register
class CamembertFamily(RobertaFamily):
    model_type = "camembert"
    architectures = _archs("Camembert")
    layer_class = "camembert.modeling_camembert:CamembertLayer"


@register
class ErnieFamily(BertFamily):
    """ERNIE: BERT's layers; its optional task-type embeddings sit with the others, outside the layers."""

    model_type = "ernie"
    architectures = _archs("Ernie", "ForPreTraining")
    base_prefix = "ernie"
    default_prefix = "ernie."
    layer_class = "ernie.modeling_ernie:ErnieLayer"
    masked_lm = False


@register
class MegatronBertFamily(BertFamily):
    """Megatron-BERT: pre-norm BERT layers (each block's LayerNorm inside it) and a final ``encoder.ln``."""

    model_type = "megatron_bert"
    aliases = ("megatron-bert",)
    architectures = _archs("MegatronBert", "ForPreTraining")
    layer_class = "megatron_bert.modeling_megatron_bert:MegatronBertLayer"
    masked_lm = False


@register
class RoFormerFamily(BertFamily):
    """RoFormer: BERT's layout with rotary positions, from the encoder's sinusoidal table
    (``encoder.embed_positions``), which it hands every layer."""

    model_type = "roformer"
    architectures = _archs("RoFormer")
    base_prefix = "roformer"
    default_prefix = "roformer."
    layer_class = "roformer.modeling_roformer:RoFormerLayer"
    masked_lm = False


@register
class MobileBertFamily(BertFamily):
    """MobileBERT: bottlenecked layers around stacked feed-forwards; trigram embeddings projected up."""

    model_type = "mobilebert"
    architectures = _archs("MobileBert", "ForPreTraining", "ForNextSentencePrediction")
    base_prefix = "mobilebert"
    default_prefix = "mobilebert."
    layer_class = "mobilebert.modeling_mobilebert:MobileBertLayer"
    layer_takes_index = False
    masked_lm = False


@register
class DebertaFamily(EncoderFamily):
    model_type = "deberta"
    architectures = _archs("Deberta")
    base_prefix = "deberta"
    default_prefix = "deberta."
    layer_class = "deberta.modeling_deberta:DebertaLayer"
    # The relative-position tables live beside the layers, outside them.
    optional_prefixes = ()
    pretraining_head_prefixes = ("lm_predictions.", "cls.")


@register
class DebertaV2Family(DebertaFamily):
    model_type = "deberta_v2"
    aliases = ("deberta-v2",)
    architectures = _archs("DebertaV2")
    layer_class = "deberta_v2.modeling_deberta_v2:DebertaV2Layer"
    pretraining_head_prefixes = ("lm_predictions.", "cls.", "mask_predictions.")


@register
class DistilBertFamily(EncoderFamily):
    model_type = "distilbert"
    architectures = _archs("DistilBert")
    base_prefix = "distilbert"
    layer_template = "transformer.layer.{i}."
    layer_class = "distilbert.modeling_distilbert:TransformerBlock"
    hidden_size_keys = ("dim", "hidden_size")
    num_layers_keys = ("n_layers", "num_hidden_layers")
    optional_prefixes = ()
    pretraining_head_prefixes = ("vocab_transform.", "vocab_layer_norm.", "vocab_projector.")
    masked_lm = True


@register
class AlbertFamily(EncoderFamily):
    """ALBERT shares weights: ``num_hidden_groups`` groups of ``inner_group_num``
    layers serve ``num_hidden_layers`` passes.  Virtual layer N is pass
    ``N // inner_group_num``, inner layer ``N % inner_group_num``; pass p runs
    group ``p // (num_hidden_layers / num_hidden_groups)`` (as AlbertTransformer does)."""

    model_type = "albert"
    architectures = _archs("Albert", "ForPreTraining")
    base_prefix = "albert"
    default_prefix = "albert."
    layer_template = "encoder.albert_layer_groups.{group}.albert_layers.{inner}."
    layer_class = "albert.modeling_albert:AlbertLayer"
    optional_prefixes = ("pooler.",)
    pretraining_head_prefixes = ("predictions.", "sop_classifier.")

    @staticmethod
    def _shape(config: Any) -> tuple[int, int, int]:
        return (int(config_value(config, ("num_hidden_layers",))),
                int(config_value(config, ("num_hidden_groups",), 1)),
                int(config_value(config, ("inner_group_num",), 1)))

    def virtual_layer_count(self, config: Any) -> int:
        passes, _, inner = self._shape(config)
        return passes * inner

    def layer_path(self, config: Any, layer_idx: int) -> str:
        passes, groups, inner = self._shape(config)
        group = int((layer_idx // inner) / (passes / groups))
        return self.layer_template.format(group=group, inner=layer_idx % inner)


@register
class ModernBertFamily(EncoderFamily):
    model_type = "modernbert"
    architectures = _archs("ModernBert")
    base_prefix = "model"
    layer_template = "layers.{i}."
    layer_class = "modernbert.modeling_modernbert:ModernBertEncoderLayer"
    layer_takes_index = True
    optional_prefixes = ()
    pretraining_head_prefixes = ("head.", "decoder.")


@register
class EuroBertFamily(EncoderFamily):
    """EuroBERT: Llama-shaped pre-norm layers (RMSNorm, rotary positions the model computes and hands every
    layer, grouped key/value heads, SwiGLU) and a final ``norm``; no segment embeddings."""

    model_type = "eurobert"
    architectures = ("EuroBertModel", "EuroBertForMaskedLM", "EuroBertForSequenceClassification",
                     "EuroBertForTokenClassification")
    base_prefix = "model"
    layer_template = "layers.{i}."
    embedding_name = "embed_tokens"
    layer_class = "eurobert.modeling_eurobert:EuroBertDecoderLayer"
    layer_takes_index = True
    optional_prefixes = ()
    pretraining_head_prefixes = ("lm_head.",)


@register
class NomicBertFamily(EncoderFamily):
    model_type = "nomic_bert"
    aliases = ("nomic-bert",)
    architectures = ("NomicBertModel", "NomicBertForMaskedLM", "NomicBertForSequenceClassification",
                     "NomicBertForTokenClassification", "NomicBertForPreTraining")
    base_prefix = "nomic_bert"
    # Published checkpoints keep Nomic's original names (transformers renames
    # them on load, see its conversion_mapping); the walk does the same here.
    layer_template = "encoder.layers.{i}."
    module_template = "layers.{i}"
    _LAYER_RENAMES: ClassVar[tuple[tuple[str, str], ...]] = (
        ("attn.out_proj.", "self_attn.o_proj."), ("mlp.fc11.", "mlp.up_proj."), ("mlp.fc12.", "mlp.gate_proj."),
        ("mlp.fc2.", "mlp.down_proj."), ("norm1.", "post_attention_layernorm."), ("norm2.", "post_mlp_layernorm."),
    )
    layer_class = "nomic_bert.modeling_nomic_bert:NomicBertLayer"
    # Nomic's original remote-code configs use GPT-2 style keys, which transformers' NomicBertConfig does
    # not read: loaded, such a config keeps them beside the class defaults it shows under the standard names
    # (hidden 768, rotary base 1000), so where an original key is there it is the checkpoint's value.
    hidden_size_keys = ("n_embd", "hidden_size")
    num_layers_keys = ("n_layer", "num_hidden_layers")
    num_heads_keys = ("n_head", "num_attention_heads")
    max_positions_keys = ("max_position_embeddings", "n_positions")
    #: original key -> the NomicBertConfig attribute holding the same quantity
    _ORIGINAL_KEYS: ClassVar[tuple[tuple[str, str], ...]] = (
        ("n_embd", "hidden_size"), ("n_layer", "num_hidden_layers"), ("n_head", "num_attention_heads"),
        ("n_inner", "intermediate_size"), ("layer_norm_epsilon", "layer_norm_eps"),
    )
    #: original switches, with the one value transformers' layers compute (None: unset is that value too)
    _ORIGINAL_LAYOUT: ClassVar[dict[str, Any]] = {
        "activation_function": "swiglu", "rotary_emb_fraction": 1.0, "rotary_emb_interleaved": False,
        "rotary_scaling_factor": None, "prenorm": False, "parallel_block": False, "use_rms_norm": False,
        "causal": False, "qkv_proj_bias": False, "mlp_fc1_bias": False, "mlp_fc2_bias": False,
    }
    optional_prefixes = ()
    pretraining_head_prefixes = ("lm_head.", "cls.")

    def ffn_width(self, config: Any) -> int | None:
        width = config_value(config, ("n_inner", "intermediate_size"))
        return int(width) if width else None

    def adapt_config(self, config: Any) -> None:
        for key, published in self._ORIGINAL_LAYOUT.items():
            value = config_value(config, (key,), published)
            if value != published:
                raise UnsupportedModelError(f"nomic_bert with {key}={value!r} is not supported: transformers' "
                                            f"NomicBertLayer computes {key}={published!r} only")
        original = [(key, attribute) for key, attribute in self._ORIGINAL_KEYS
                    if config_value(config, (key,)) is not None]
        for key, attribute in original:
            setattr(config, attribute, config_value(config, (key,)))
        base = config_value(config, ("rotary_emb_base",))
        if base is not None:
            config.rope_parameters = {**(config.rope_parameters or {}), "rope_theta": float(base)}
        if original:  # NomicBertConfig derived it from the defaults when it was loaded
            config.head_dim = config.hidden_size // config.num_attention_heads

    def convert_layer_tensors(self, tensors: dict[str, Any]) -> dict[str, Any]:
        converted = {}
        for key, tensor in tensors.items():
            if key.startswith("attn.Wqkv."):  # fused q/k/v rows, split in three
                suffix = key[len("attn.Wqkv."):]
                for name, part in zip(("q_proj", "k_proj", "v_proj"), tensor.chunk(3, dim=0)):
                    converted[f"self_attn.{name}.{suffix}"] = part.contiguous()
                continue
            for old, new in self._LAYER_RENAMES:
                if key.startswith(old):
                    key = new + key[len(old):]
                    break
            converted[key] = tensor
        return converted

    def convert_key(self, key: str) -> str:
        return "embeddings.LayerNorm." + key[len("emb_ln."):] if key.startswith("emb_ln.") else key


@register
class MPNetFamily(EncoderFamily):
    """MPNet: BERT-shaped layers, RoBERTa-style positions (numbered from
    ``padding_idx + 1``, ``padding_idx`` fixed at 1) and no segment embeddings.
    The relative position bias is computed once by the encoder from its own
    ``encoder.relative_attention_bias`` table and fed to every layer: that
    table is outside the layers, so the walk loads it with the embeddings."""

    model_type = "mpnet"
    architectures = _archs("MPNet")
    base_prefix = "mpnet"
    default_prefix = "mpnet."
    layer_class = "mpnet.modeling_mpnet:MPNetLayer"
    position_offset_from_pad = True
    pretraining_head_prefixes = ("lm_head.",)
