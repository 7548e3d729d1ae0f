"""A sentence-transformers folder, read: the one module that opens the files a model folder keeps besides its
encoder's weights.

sentence-transformers saves a model as its modules in order (``modules.json``: Transformer, Dense, Pooling,
LayerNorm, Normalize, SpladePooling, MultiVectorMask ...), each in a folder with its own ``config.json`` (and,
for Dense and LayerNorm, weights), beside the model's own settings (``config_sentence_transformers.json``:
prompts, similarity, model type; ``sentence_bert_config.json``: the length it was trained for), its card
(``README.md``: a Matryoshka loss's sizes) and its tokenizer's configs (the special tokens' names).  Those
files are read here; what they mean for one kind of model is its own module's: :mod:`embedders` (pooling,
SPLADE), :mod:`multi_vector` (late interaction, whose legacy formats keep more keys in the same files) and
:mod:`m3_heads` (BGE-M3's heads, whose state dicts :func:`state_dict` loads).
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nexus_sli.exporter.errors import CheckpointError, ModelSourceError, NexusError
# the served code's modes: what the export accepts is what the server can do
from nexus_sli.exporter.triton.python_models.encoding import POOLING_MODES, SPLADE_ACTIVATIONS, SPLADE_STRATEGIES

from . import dense
from .dense import Dense
from .export_report import LayerNormRecord
from .pickles import read_state_dict

log = logging.getLogger(__name__)

#: The model's own settings, and the Transformer module's (the trained length).
ST_CONFIG = "config_sentence_transformers.json"
SENTENCE_BERT_CONFIG = "sentence_bert_config.json"
#: The names the Transformer module's settings are saved under, the first one found read, as sentence-transformers
#: reads them (older releases named the file after the model type).
TRANSFORMER_CONFIGS = (SENTENCE_BERT_CONFIG, "sentence_roberta_config.json", "sentence_distilbert_config.json",
                       "sentence_camembert_config.json", "sentence_albert_config.json",
                       "sentence_xlm-roberta_config.json", "sentence_xlnet_config.json")
#: The package whose modules the export reproduces: a module of another package (a model's own code, loaded
#: with trust_remote_code) may compute anything under a familiar class name.
ST_PACKAGE = "sentence_transformers."
#: The tokenizer's configs that name its special tokens; the later names win where both do.
TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP = "tokenizer_config.json", "special_tokens_map.json"
#: torch.nn.LayerNorm's epsilon, which sentence-transformers' LayerNorm module keeps (it saves no other)
LAYER_NORM_EPS = 1e-5
#: The modules a sparse encoder folder may hold besides its SpladePooling: the masked-LM transformer
#: (``MLMTransformer``, or ``Transformer`` with ``transformer_task: fill-mask`` since sentence-transformers 6).
SPARSE_TRANSFORMERS = ("MLMTransformer", "Transformer")


def read_json(file: Path) -> dict:
    """A JSON file of the folder; empty where it is absent; a ModelSourceError naming it where it is no JSON."""
    if not file.is_file():
        return {}
    try:
        return json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelSourceError(f"{file} is not valid JSON ({exc}): a truncated download, or a Git LFS pointer? "
                               "Fetch the file again") from None


@dataclass(frozen=True)
class Module:
    """One entry of ``modules.json``."""

    #: its class, dotted (``sentence_transformers.models.Pooling``)
    type: str
    #: its folder (the model's own for the Transformer)
    path: Path

    @property
    def kind(self) -> str:
        """Its class name (``Pooling``): matched whole, so ``Pooling`` is not ``SpladePooling``."""
        return self.type.rsplit(".", 1)[-1]

    @property
    def config(self) -> dict:
        """Its ``config.json`` (empty where it has none)."""
        return read_json(self.path / "config.json")


def modules(path: Path) -> list[Module]:
    """The folder's modules in order (empty where it has no ``modules.json``)."""
    return [Module(entry.get("type", ""), path / entry.get("path", "")) for entry in read_json(path / "modules.json")]


def module_folder(path: Path, kind: str) -> Path | None:
    """The folder of the first module of class ``kind`` (``Pooling``, ``SpladePooling``, ``Normalize``); None
    where the model has none."""
    return next((module.path for module in modules(path) if module.kind == kind), None)


def st_config(path: Path) -> dict:
    """``config_sentence_transformers.json`` (empty where the folder has none)."""
    return read_json(path / ST_CONFIG)


#: The sentence-transformers pipelines an embedding export reproduces, by module class name, in order:
#: Dense modules on the token states before the pooling, and on the pooled vector after it.
_SERVED_PIPELINE = re.compile(r"Transformer( Dense)* Pooling( Dense)*( LayerNorm)?( Normalize)?")
_SERVED_PIPELINE_TEXT = "Transformer -> [Dense ...] -> Pooling -> [Dense ...] -> [LayerNorm] -> [Normalize]"


def check_pipeline(path: Path) -> None:
    """Refuse a sentence-transformers pipeline with modules the export would leave out (one it does not
    know, a LayerNorm before the normalisation) or reproduce otherwise than it runs (a module of another
    package, a Transformer that answers another output, a Normalize of another feature): served vectors
    would silently differ."""
    found = modules(path)
    kinds = tuple(module.kind for module in found)
    if kinds and not _SERVED_PIPELINE.fullmatch(" ".join(kinds)):
        raise NexusError(f"{path / 'modules.json'} lists the modules {', '.join(kinds)}; the export reproduces "
                         f"{_SERVED_PIPELINE_TEXT} and would leave the others out")
    foreign = [module.type for module in found if not module.type.startswith(ST_PACKAGE)]
    if foreign:
        raise NexusError(f"{path / 'modules.json'} lists {', '.join(foreign)}: not sentence-transformers' own "
                         "modules, so the export cannot know what they compute")
    if found:
        _check_transformer(path, transformer_config(path))
    for module in found:
        if module.kind == "Normalize":
            _check_feature(module.config, module.path / "config.json", "Normalize")


def _check_transformer(path: Path, settings: dict) -> None:
    """Refuse a Transformer module whose saved settings make sentence-transformers read other token states than
    the encoder's last hidden states, or tokenize otherwise than the served tokenizer (its ``processing_kwargs``
    override the truncation length, the special tokens ... at every call)."""
    task = settings.get("transformer_task")
    if task not in (None, "feature-extraction"):
        raise NexusError(f"{path}: the Transformer module runs the task {task!r}; the export pools the encoder's "
                         "token states (feature-extraction)")
    output = ((settings.get("modality_config") or {}).get("text") or {}).get("method_output_name")
    if output not in (None, "last_hidden_state"):
        raise NexusError(f"{path}: the Transformer module reads the model's {output!r}; the export pools its "
                         "last_hidden_state")
    overrides = {key: value for key, value in (settings.get("processing_kwargs") or {}).items()
                 if key in ("text", "common") and value}
    if overrides:
        raise NexusError(f"{path}: the Transformer module's processing_kwargs {overrides} change how "
                         "sentence-transformers tokenizes each text; the export tokenizes as the model's "
                         "tokenizer.json and max_seq_length say")


def _check_feature(config: dict, file: Path, kind: str) -> None:
    """Refuse a module that reads or writes another feature than the pooled vector (a Normalize of the token
    states would leave the sentence embedding as it is)."""
    source = config.get("module_input_name") or dense.SENTENCE
    target = config.get("module_output_name") or source
    if (source, target) != (dense.SENTENCE, dense.SENTENCE):
        raise NexusError(f"{file}: the {kind} module reads {source!r} and writes {target!r}; the export applies it "
                         f"to the pooled {dense.SENTENCE!r} only")


def dense_modules(path: Path, allow_pickle: bool = False) -> tuple[list[Dense], list[Dense]]:
    """The pipeline's Dense modules in ``modules.json`` order: (those on the token states, before the
    pooling; those on the pooled vector, after it).  Empty where it has none.  ``allow_pickle``: a module's
    weights may be read from ``pytorch_model.bin`` (:mod:`pickles`)."""
    check_pipeline(path)
    found: dict[bool, list[Dense]] = {False: [], True: []}
    pooled = False
    for module in modules(path):
        pooled = pooled or module.kind == "Pooling"
        if module.kind == "Dense":
            found[pooled].append(read_dense(module.path, dense.SENTENCE if pooled else dense.TOKENS,
                                            allow_pickle=allow_pickle))
    return found[False], found[True]


def _weights(folder: Path, allow_pickle: bool) -> dict[str, np.ndarray]:
    """The module's tensors: model.safetensors, else pytorch_model.bin under the pickle policy (:mod:`pickles`)."""
    if (folder / "model.safetensors").is_file():
        from safetensors.numpy import load_file

        return load_file(str(folder / "model.safetensors"))
    if (folder / "pytorch_model.bin").is_file():
        loaded = read_state_dict(folder / "pytorch_model.bin", allow_pickle)
        return {key: value.float().numpy() for key, value in loaded.items()}
    raise NexusError(f"{folder} has neither model.safetensors nor pytorch_model.bin: the Dense module's "
                     "weights cannot be read")


def _tensor(tensors: dict[str, np.ndarray], key: str, shape: tuple[int, ...], folder: Path) -> np.ndarray:
    if key not in tensors:
        raise NexusError(f"{folder}: the Dense module's weights lack {key} (they have {', '.join(sorted(tensors))})")
    if tuple(tensors[key].shape) != shape:
        raise NexusError(f"{folder}: {key} has shape {tuple(tensors[key].shape)}, its config says {shape}")
    return tensors[key].astype(np.float32)


def read_dense(folder: Path, expected_input: str, unnamed_input: str = dense.SENTENCE,
               allow_pickle: bool = False) -> Dense:
    """The Dense module in ``folder``; ``expected_input``: the feature its place in the pipeline feeds it
    (:data:`dense.TOKENS` before the pooling, :data:`dense.SENTENCE` after); ``unnamed_input``: the feature a
    config that names none reads (a multi-vector model's older saves imply the token states);
    ``allow_pickle``: its weights may be read from ``pytorch_model.bin``."""
    file = folder / "config.json"
    config = read_json(file)
    if "in_features" not in config or "out_features" not in config:
        raise NexusError(f"{file} does not give the Dense module's in_features and out_features")
    source = config.get("module_input_name", unnamed_input)
    if source != expected_input or config.get("module_output_name", source) not in (None, source):
        raise NexusError(f"{file}: a Dense module at this place of the pipeline must read and write "
                         f"{expected_input!r}; it reads {source!r} and writes "
                         f"{config.get('module_output_name') or source!r}")
    size_in, size_out = int(config["in_features"]), int(config["out_features"])
    tensors = _weights(folder, allow_pickle)
    residual = bool(config.get("use_residual", False))
    return Dense(_tensor(tensors, "linear.weight", (size_out, size_in), folder),
                 _tensor(tensors, "linear.bias", (size_out,), folder) if config.get("bias", True) else None,
                 dense.activation_name(config.get("activation_function") or dense.DEFAULT_ACTIVATION, file), source,
                 residual, _tensor(tensors, "residual.weight", (size_out, size_in), folder)
                 if residual and size_in != size_out else None)


def pooling_mode(path: Path) -> str:
    """The sentence-transformers pooling mode, or mean pooling (with a warning)."""
    check_pipeline(path)
    folder = module_folder(path, "Pooling")
    if folder is None:
        log.warning("%s has no sentence-transformers pooling config; using mean pooling", path)
        return "mean"
    modes = _pooling_modes(read_json(folder / "config.json"))
    if len(modes) != 1 or modes[0] not in POOLING_MODES:
        # several modes: sentence-transformers concatenates their vectors, which the served pooling does not
        raise NexusError(
            f"unsupported pooling {' + '.join(map(str, modes)) or 'none'} in {folder / 'config.json'}; "
            f"the export pools with one of the modes {', '.join(POOLING_MODES)}"
        )
    return modes[0]


#: sentence-transformers' older Pooling configs: a flag per mode (its mode names since the ``pooling_mode`` key)
_MODE_FLAGS = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max", "pooling_mode_mean_tokens": "mean",
               "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
               "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}


def _pooling_modes(config: dict) -> list:
    """The modes a Pooling config turns on: its ``pooling_mode`` (one mode, or a list of them), which wins over
    the older flags as in sentence-transformers, else the flags that are set (in the order sentence-transformers
    concatenates their vectors)."""
    if "pooling_mode" in config:
        mode = config["pooling_mode"]
        return list(mode) if isinstance(mode, list) else [mode]
    unknown = [key.removeprefix("pooling_mode_") for key, value in config.items()
               if key.startswith("pooling_mode_") and key not in _MODE_FLAGS and value]
    return [mode for key, mode in _MODE_FLAGS.items() if config.get(key)] + unknown


def layer_norm(path: Path) -> LayerNormRecord | None:
    """The weight, bias and epsilon of the pipeline's LayerNorm module (between the pooling and the
    normalisation: a Matryoshka model's vectors are then cut after it), None where it has none."""
    folder = module_folder(path, "LayerNorm")
    if folder is None:
        return None
    weights = folder / "model.safetensors"
    if not weights.is_file():
        raise NexusError(f"{folder} has no model.safetensors: the LayerNorm module's weights cannot be read "
                         "(pickle weights are not loaded)")
    from safetensors.numpy import load_file

    tensors = load_file(str(weights))
    if {"norm.weight", "norm.bias"} - set(tensors):
        raise NexusError(f"{weights} lacks norm.weight or norm.bias (it has {', '.join(sorted(tensors))})")
    return LayerNormRecord(weight=tensors["norm.weight"].astype("float32").tolist(),
                           bias=tensors["norm.bias"].astype("float32").tolist(), eps=LAYER_NORM_EPS)


def normalizes(path: Path) -> bool:
    """True when the sentence-transformers pipeline ends in a Normalize module."""
    return module_folder(path, "Normalize") is not None


def splade_config(path: Path) -> tuple[str, str]:
    """(pooling strategy, activation) of the folder's SpladePooling module; ``max`` and ``relu`` (its
    defaults) where the folder has none.  Modules the export cannot reproduce are refused by name."""
    others = [module.type or "?" for module in modules(path)
              if not module.type.endswith(("SpladePooling", *SPARSE_TRANSFORMERS))]
    if others:
        raise NexusError(f"{path / 'modules.json'}: the sparse-embedding export reproduces a masked-LM transformer "
                         f"followed by SpladePooling only, not {', '.join(others)}")
    folder = module_folder(path, "SpladePooling")
    config = read_json(folder / "config.json") if folder else {}
    strategy, activation = config.get("pooling_strategy", "max"), config.get("activation_function", "relu")
    if strategy not in SPLADE_STRATEGIES or activation not in SPLADE_ACTIVATIONS:
        raise NexusError(f"unsupported SpladePooling pooling_strategy {strategy!r} / activation_function "
                         f"{activation!r} in {folder / 'config.json'}; known: {', '.join(SPLADE_STRATEGIES)} / "
                         f"{', '.join(SPLADE_ACTIVATIONS)}")
    return strategy, activation


def is_sparse_encoder(path: Path) -> bool:
    """Whether the folder is a sentence-transformers SparseEncoder with SpladePooling (``--task auto``
    exports it as sparse embeddings; a ``*ForMaskedLM`` architecture alone does not say so)."""
    return module_folder(path, "SpladePooling") is not None


def prompts(path: Path) -> tuple[dict[str, str], str | None]:
    """The named prompts of a sentence-transformers folder (``config_sentence_transformers.json``'s
    ``prompts``: name -> the text put in front of every input) and the one applied when a request
    names none (``default_prompt_name``, or None).  sentence-transformers prepends a prompt to the
    text before tokenising; so does the served tokenizer step."""
    file = path / ST_CONFIG
    config = read_json(file)
    found = config.get("prompts") or {}
    if not isinstance(found, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in found.items()):
        raise NexusError(f"{file}: prompts must map names to strings, got {found!r}")
    default = config.get("default_prompt_name")
    if default is not None and default not in found:
        raise NexusError(f"{file}: default_prompt_name {default!r} is not one of its prompts "
                         f"({', '.join(found) or 'none'})")
    folder = module_folder(path, "Pooling")
    if found and folder is not None and read_json(folder / "config.json").get("include_prompt", True) is False:
        # pooling without the prompt's tokens would need a mask apart from the attention mask the encoder reads
        raise NexusError(f"{folder / 'config.json'} pools without the prompt's tokens (include_prompt: false); "
                         "served prompts are pooled with the text, so this model cannot be exported faithfully")
    return {name: text for name, text in found.items()}, default


#: How sentence-transformers' model cards record the sizes a Matryoshka loss trained for.
_MATRYOSHKA_DIMS = re.compile(r'"matryoshka_dims"\s*:\s*\[([\d,\s]+)\]')


def matryoshka_dims(path: Path, hidden_size: int) -> list[int]:
    """The embedding sizes the model was trained for, largest first, where its card names them (the
    ``matryoshka_dims`` of the MatryoshkaLoss that sentence-transformers writes into README.md);
    empty when it does not.  Any size up to ``hidden_size`` can be asked for either way."""
    readme = path / "README.md"
    found = _MATRYOSHKA_DIMS.search(readme.read_text(errors="replace")) if readme.is_file() else None
    if found is None:
        return []
    dims = sorted({int(d) for d in found.group(1).replace(" ", "").split(",") if d}, reverse=True)
    return [d for d in dims if 0 < d <= hidden_size]


def trained_length(path: Path, limit: int) -> int:
    """The sequence length the folder says the model was trained for (sentence-transformers'
    ``max_seq_length``, else the tokenizer's ``model_max_length``), never past ``limit`` positions."""
    trained = transformer_config(path).get("max_seq_length")
    if trained is None:
        trained = read_json(path / TOKENIZER_CONFIG).get("model_max_length")
    if isinstance(trained, (int, float)) and 0 < trained < limit:
        return int(trained)
    return limit


def transformer_config(path: Path) -> dict:
    """The Transformer module's own saved settings (its ``sentence_bert_config.json``, or an older release's
    name for it: :data:`TRANSFORMER_CONFIGS`; the model's folder where ``modules.json`` lists no Transformer)."""
    folder = next((module.path for module in modules(path) if module.kind == "Transformer"), path)
    return next((config for config in (read_json(folder / name) for name in TRANSFORMER_CONFIGS) if config), {})


def lowercases(path: Path) -> bool:
    """Whether sentence-transformers lowercases the texts before its tokenizer reads them (the Transformer
    module's ``do_lower_case``)."""
    return bool(transformer_config(path).get("do_lower_case", False))


def special_tokens(file: Path) -> dict[str, str]:
    """The special tokens a tokenizer config names, by role (``cls_token``, ``mask_token`` ...): an
    AddedToken's ``content`` where the file keeps its fields.  Empty where the file is absent."""
    named = {}
    for role, value in read_json(file).items():
        value = value.get("content") if isinstance(value, dict) else value
        if role.endswith("_token") and isinstance(value, str):
            named[role] = value
    return named


def state_dict(file: Path, shapes: dict[str, tuple], allow_pickle: bool) -> dict[str, np.ndarray]:
    """The state dict pickled at ``file`` (read under the pickle policy, :mod:`pickles`) as fp32 arrays, checked
    against ``shapes`` (``None``: any size there); a :class:`CheckpointError` naming the file otherwise."""
    state = read_state_dict(file, allow_pickle)
    if sorted(state) != sorted(shapes):
        raise CheckpointError(f"{file.name} holds {sorted(state)}; expected a linear layer's {sorted(shapes)}")
    arrays = {key: value.detach().float().numpy() for key, value in state.items()}
    for key, shape in shapes.items():
        got = arrays[key].shape
        if len(got) != len(shape) or any(want not in (None, size) for want, size in zip(shape, got)):
            expected = tuple("any" if size is None else size for size in shape)
            raise CheckpointError(f"{file.name}: {key} has shape {got}, expected {expected}")
    return arrays


def architectures(path: Path) -> list[str]:
    """The model classes its transformers ``config.json`` names."""
    return list(read_json(path / "config.json").get("architectures") or [])

