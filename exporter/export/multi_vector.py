"""A late-interaction (ColBERT) model's folder, read as sentence-transformers' ``MultiVectorEncoder`` reads it.

Three save formats load as a ``MultiVectorEncoder``: its own (``modules.json``:
Transformer, Dense, MultiVectorMask, Normalize), PyLate's (``model_type``
``ColBERT``, flat marker and length keys) and Stanford ColBERT's (``HF_ColBERT``
with a root ``linear.weight`` and ``artifact.metadata``).  Each is read here into
one :class:`MultiVectorConfig`: the two sides (``python_models/sides.py``), the
projection, the normalisation and the similarity, without importing
sentence-transformers.
"""

from __future__ import annotations

import logging
import re
import string
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tokenizers import AddedToken, Tokenizer

from nexus_sli.exporter.errors import NexusError, UnsupportedModelError
from nexus_sli.exporter.triton.python_models.encoding import l2_normalize
from nexus_sli.exporter.triton.python_models.sides import DOCUMENT, QUERY, Expansion, Side, Sides

from . import dense, st_folder
from .dense import Dense
from .st_folder import architectures, read_json, st_config, trained_length

log = logging.getLogger(__name__)

#: The similarities a late-interaction model may name: the sum over query vectors of their best
#: document match, and that sum divided by the number of query vectors.
SIMILARITIES = ("maxsim", "meanmaxsim")
#: ``MultiVectorConfig.format`` of each save format
NATIVE, PYLATE, STANFORD = "sentence-transformers", "pylate", "stanford"
#: The query expansion strategies: ``fixed`` truncates and pads every query to the expansion length,
#: ``min`` only pads short ones to it.
EXPANSION_STRATEGIES = ("fixed", "min")

#: The pipelines the export reproduces, by module class name (sentence-transformers' own save; PyLate 3
#: listed the first two only and implied the mask and the normalisation).
_PIPELINES = {NATIVE: re.compile(r"Transformer( Dense)* MultiVectorMask( Normalize)?"),
              PYLATE: re.compile(r"Transformer( Dense)*")}
_PIPELINE_TEXT = {NATIVE: "Transformer -> [Dense ...] -> MultiVectorMask -> [Normalize]",
                  PYLATE: "Transformer -> [Dense ...]"}
#: Where a legacy save names no expansion length: classic ColBERT's query length.
_LEGACY_EXPANSION_LENGTH = 32
#: The Transformer settings PyLate saved as top-level keys of config_sentence_transformers.json.
_PYLATE_TRANSFORMER_KEYS = ("query_length", "document_length", "query_expansion")
_PYLATE_MARKER_KEYS = _PYLATE_TRANSFORMER_KEYS + ("do_query_expansion", "attend_to_expansion_tokens",
                                                  "attend_to_mask_tokens", "query_prefix", "document_prefix",
                                                  "skiplist_words")
#: Stanford ColBERT's markers where its artifact.metadata names none.
_STANFORD_MARKERS = {QUERY: "[unused0]", DOCUMENT: "[unused1]"}
#: The tokens tried as the mask and end-of-sequence tokens where the tokenizer's config names none.
_CONVENTIONAL = {"mask_token": ("[MASK]", "<mask>"), "eos_token": ("</s>",)}


@dataclass(frozen=True)
class MultiVectorConfig:
    sides: Sides
    #: the projection(s) on the token states, in order (sentence-transformers' Dense on ``token_embeddings``)
    dense: tuple[Dense, ...]
    #: each token vector L2-normalised (the Normalize module)
    normalize: bool
    #: one of :data:`SIMILARITIES`
    similarity: str
    #: ``sentence-transformers``, ``pylate`` or ``stanford``
    format: str
    #: marker tokens sentence-transformers registers as special tokens for the legacy formats; the
    #: served tokenizer.json must have them too
    added_special_tokens: tuple[str, ...] = ()


@dataclass
class _Saved:
    """What a folder says, as sentence-transformers gathers it before building its modules."""

    #: the Transformer module's settings: query_length, document_length, query_expansion
    transformer: dict = field(default_factory=dict)
    prompts: dict = field(default_factory=dict)
    #: the legacy formats' markers (side -> marker), registered as special tokens
    markers: dict = field(default_factory=dict)
    #: the MultiVectorMask module's settings
    mask: dict = field(default_factory=dict)
    dense: tuple[Dense, ...] = ()
    normalize: bool = True
    similarity: str | None = None


def multi_vector_format(path: Path) -> str | None:
    """The save format of a late-interaction model's folder (:data:`NATIVE`, :data:`PYLATE`,
    :data:`STANFORD`), None for any other folder; sentence-transformers' model type comes first."""
    model_type = st_config(path).get("model_type")
    stanford = "HF_ColBERT" in architectures(path)
    if model_type == "MultiVectorEncoder" and stanford and not (path / "modules.json").is_file():
        return STANFORD  # saved without its modules: built from the checkpoint as a Stanford one is
    if model_type is not None:
        return {"MultiVectorEncoder": NATIVE, "ColBERT": PYLATE}.get(model_type)
    return STANFORD if stanford else None


def is_multi_vector(path: Path) -> bool:
    """Whether the folder is a late-interaction model that sentence-transformers' ``MultiVectorEncoder``
    loads: its own save, PyLate's or Stanford ColBERT's."""
    return multi_vector_format(path) is not None


def read_multi_vector(path: Path, tokenizer: Tokenizer, max_positions: int, *, similarity: str | None = None,
                      allow_pickle: bool = False) -> MultiVectorConfig:
    """The late-interaction model at ``path`` as ``MultiVectorEncoder`` loads it.

    ``tokenizer``: the tokenizer the export serves, as the folder has it (ids of the skiplist and the
    expansion token are resolved with it; :func:`add_markers` then adds the markers the result lists);
    ``max_positions``: the encoder's positions (a side longer than that is refused, sentence-transformers
    would fail on long texts); ``similarity``: one asked for in place of the model's;
    ``allow_pickle``: a Stanford checkpoint's projection, or a Dense module's weights, may be read from
    ``pytorch_model.bin``."""
    found = multi_vector_format(path)
    if found is None:
        raise NexusError(f"{path} is not a late-interaction model: its config_sentence_transformers.json names "
                         "no model_type MultiVectorEncoder or ColBERT and its config.json no HF_ColBERT")
    _refuse_retrieval(path)
    saved = _read_stanford(path, allow_pickle) if found == STANFORD else _read_listed(path, found, allow_pickle)
    sides = _sides(path, saved, tokenizer, trained_length(path, max_positions), max_positions)
    return MultiVectorConfig(sides, saved.dense, saved.normalize, _similarity(path, saved.similarity, similarity),
                             found, _markers_to_register(tokenizer, saved.markers.values()))


def _refuse_retrieval(path: Path) -> None:
    retrieval = [name for name in architectures(path) if name.endswith("ForRetrieval")]
    if retrieval:
        raise UnsupportedModelError(
            f"{path / 'config.json'} names {retrieval[0]}: a transformers retrieval model (ColPali family) whose "
            "processor and head the export does not reproduce")


def _similarity(path: Path, saved: str | None, asked: str | None) -> str:
    """The one asked for, else the saved ``similarity_fn_name`` where it is a late-interaction one, else
    MaxSim (sentence-transformers lets a legacy save's ``cosine`` or PyLate's ``MaxSim`` fall through)."""
    if asked is not None:
        if asked not in SIMILARITIES:
            raise NexusError(f"unknown similarity {asked!r} for the late-interaction model at {path}; "
                             f"known: {', '.join(SIMILARITIES)}")
        return asked
    if saved is not None and saved not in SIMILARITIES:
        log.warning("%s: similarity_fn_name %r is not a late-interaction similarity; scoring with maxsim, as "
                    "sentence-transformers does", path / "config_sentence_transformers.json", saved)
    return saved if saved in SIMILARITIES else "maxsim"


def _read_listed(path: Path, found: str, allow_pickle: bool) -> _Saved:
    """A folder with modules.json: sentence-transformers' own save, or PyLate 3's (whose mask and
    normalisation were implied: PyLate skipped punctuation unless its config named the words)."""
    saved = _from_st_config(path)
    modules = st_folder.modules(path)
    _check_pipeline(path, found, [module.kind for module in modules])
    transformer = st_folder.transformer_config(path)  # the Transformer's own settings win over the legacy keys
    saved.transformer.update({key: transformer[key] for key in _PYLATE_TRANSFORMER_KEYS if key in transformer})
    saved.dense = tuple(st_folder.read_dense(module.path, dense.TOKENS, unnamed_input=dense.TOKENS,
                                             allow_pickle=allow_pickle)
                        for module in modules if module.kind == "Dense")
    if found == PYLATE:
        words = saved.mask.get("skiplist_words")
        saved.mask = {"skiplist_words": list(string.punctuation) if words is None else words}
    else:
        saved.mask = next(module for module in modules if module.kind == "MultiVectorMask").config
        saved.normalize = any(module.kind == "Normalize" for module in modules)
    return saved


def _check_pipeline(path: Path, found: str, kinds: list[str]) -> None:
    """Refuse modules the export would leave out: a token pooling above all, which changes the vectors."""
    file = path / "modules.json"
    pooling = [kind for kind in kinds if kind.endswith("TokenPooling")]
    if pooling:
        raise NexusError(f"{file} lists {pooling[0]}: a token pooling clusters document vectors at encode time; "
                         "the export does not reproduce it (export the model saved without it)")
    if not _PIPELINES[found].fullmatch(" ".join(kinds)):
        raise NexusError(f"{file} lists the modules {', '.join(kinds) or 'none'}; the export reproduces "
                         f"{_PIPELINE_TEXT[found]} and would leave the others out")


def _from_st_config(path: Path) -> _Saved:
    """config_sentence_transformers.json as ``MultiVectorEncoder`` parses it: prompts and similarity, and the
    legacy PyLate keys (markers put in front of the saved prompts, flat lengths and expansion settings)."""
    config = st_config(path)
    prompts = dict(config.get("prompts") or {})
    markers = {}
    for key, side in (("query_prefix", QUERY), ("document_prefix", DOCUMENT)):
        if key in config:
            markers[side] = config[key] or ""
            prompts[side] = markers[side] + (prompts.get(side) or "").removeprefix(markers[side])
    knobs = {key: config[key] for key in _PYLATE_TRANSFORMER_KEYS
             if key in config and (config[key] is not None or key == "query_expansion")}
    if "query_expansion" not in knobs and any(key in config for key in _PYLATE_MARKER_KEYS):
        knobs["query_expansion"] = _legacy_expansion(config, knobs)
    return _Saved(knobs, prompts, markers, {"skiplist_words": config.get("skiplist_words")},
                  similarity=config.get("similarity_fn_name"))


def _legacy_expansion(config: dict, knobs: dict) -> dict | None:
    """PyLate's flat expansion keys: on unless ``do_query_expansion`` is false, fixed, to the saved
    ``query_length`` (which then stops capping queries: it was PyLate's pad target)."""
    if config.get("do_query_expansion") is False:
        return None
    attend = config.get("attend_to_expansion_tokens", config.get("attend_to_mask_tokens"))
    length = knobs.pop("query_length", None) or config.get("query_length") or _LEGACY_EXPANSION_LENGTH
    return {"strategy": "fixed", "attend": bool(attend), "length": length}


def _read_stanford(path: Path, allow_pickle: bool) -> _Saved:
    """Stanford ColBERT: settings in artifact.metadata (queries always expanded, fixed), the projection the
    checkpoint's root ``linear.weight`` (no bias, no activation), punctuation skipped unless it says not."""
    saved = _from_st_config(path)
    metadata = read_json(path / "artifact.metadata")
    for side, key in ((QUERY, "query_token_id"), (DOCUMENT, "doc_token_id")):
        saved.markers[side] = (metadata.get(key) or _STANFORD_MARKERS[side]) + " "
        if saved.prompts.get(side) is None:
            saved.prompts[side] = saved.markers[side]
    if metadata.get("doc_maxlen") is not None:
        saved.transformer.setdefault("document_length", metadata["doc_maxlen"])
    saved.transformer.setdefault("query_expansion", {
        "strategy": "fixed", "attend": bool(metadata.get("attend_to_mask_tokens")),
        "length": metadata.get("query_maxlen") or _LEGACY_EXPANSION_LENGTH})
    saved.mask = {"skiplist_words": list(string.punctuation) if metadata.get("mask_punctuation", True) else []}
    saved.dense = (Dense(_root_projection(path, allow_pickle), None, "Identity", dense.TOKENS),)
    return saved


def _root_projection(path: Path, allow_pickle: bool) -> np.ndarray:
    from .checkpoint import Checkpoint

    with Checkpoint(path, allow_pickle=allow_pickle) as checkpoint:
        if "linear.weight" not in checkpoint:
            raise NexusError(f"{path}: a Stanford ColBERT checkpoint (HF_ColBERT) keeps its projection as the "
                             "tensor linear.weight, which this one lacks")
        weight = checkpoint.get("linear.weight").float().numpy()
    if weight.ndim != 2:
        raise NexusError(f"{path}: linear.weight has shape {tuple(weight.shape)}; a projection is [dim, hidden]")
    return weight


def _sides(path: Path, saved: _Saved, tokenizer: Tokenizer, model_max: int, max_positions: int) -> Sides:
    """Each side's prompt, truncation length, expansion and scoring rules (``model_max``: the length a side
    that names none is cut at, the tokenizer's as sentence-transformers caps it)."""
    settings = saved.transformer
    expansion = _expansion(path, settings.get("query_expansion"), settings.get("query_length"), tokenizer)
    if expansion is None:
        query_length = settings.get("query_length") or model_max
    elif expansion.strategy == "fixed":
        query_length = expansion.length
    else:  # a query is cut at its own length, and shorter ones are padded to the expansion's
        query_length = max(settings["query_length"], expansion.length) if settings.get("query_length") else model_max
    lengths = {QUERY: query_length, DOCUMENT: settings.get("document_length") or model_max}
    _check_lengths(path, {**lengths, **({"query expansion": expansion.length} if expansion else {})}, max_positions)
    skiplist_ids = _skiplist_ids(tokenizer, saved.mask.get("skiplist_words") or [])
    tasks = saved.mask.get("skiplist_tasks")
    tasks = [DOCUMENT] if tasks is None else [tasks] if isinstance(tasks, str) else list(tasks)
    keep = saved.mask.get("keep_only_token_ids")

    def side(name: str) -> Side:
        return Side((saved.prompts.get(name) or ""), lengths[name], expansion if name == QUERY else None,
                    bool(skiplist_ids) and name in tasks,
                    tuple(int(i) for i in keep) if keep and name != QUERY else None)

    return Sides(side(QUERY), side(DOCUMENT), skiplist_ids)


def _check_lengths(path: Path, lengths: dict[str, int], max_positions: int) -> None:
    for name, length in lengths.items():
        if not isinstance(length, int) or isinstance(length, bool) or length < 1:
            raise NexusError(f"{path}: the {name} length {length!r} is not a positive number of tokens")
        if length > max_positions:
            raise NexusError(f"{path}: the {name} length is {length} tokens; the encoder has {max_positions} "
                             "positions (sentence-transformers would fail on texts that long)")


def _expansion(path: Path, raw: dict | None, query_length: int | None, tokenizer: Tokenizer) -> Expansion | None:
    """The query expansion, checked as sentence-transformers checks it when the model loads."""
    if raw is None:
        return None
    strategy, length, attend = raw.get("strategy"), raw.get("length"), raw.get("attend", False)
    unknown = set(raw) - {"strategy", "attend", "token", "length"}
    if unknown or strategy not in EXPANSION_STRATEGIES or not isinstance(attend, bool) \
            or not isinstance(length, int) or isinstance(length, bool) or length < 1:
        raise NexusError(f"{path}: query_expansion {raw!r} is not one sentence-transformers loads: strategy "
                         f"{' or '.join(EXPANSION_STRATEGIES)}, a positive length, attend true or false")
    if query_length is not None and query_length < length:
        raise NexusError(f"{path}: query_length {query_length} is below the query expansion's length {length}, "
                         "which sentence-transformers refuses")
    return Expansion(strategy, length, _expansion_id(path, raw.get("token"), tokenizer), attend)


def _expansion_id(path: Path, token: str | None, tokenizer: Tokenizer) -> int:
    """The expansion token's id: the one named, else the mask token's, else the end-of-sequence token's."""
    if token is not None:
        found = tokenizer.token_to_id(token)
        if found is None:
            raise NexusError(f"{path}: the query expansion token {token!r} is not in the tokenizer's vocabulary")
        return found
    for role in ("mask_token", "eos_token"):
        found = _special_id(path, tokenizer, role)
        if found is not None:
            return found
    raise NexusError(f"{path}: the query expansion names no token and the tokenizer has no mask or "
                     "end-of-sequence token to pad queries with")


def _special_id(path: Path, tokenizer: Tokenizer, role: str) -> int | None:
    """The id of the tokenizer's ``role`` token (``mask_token``): as its config names it, else the
    conventional spelling the tokenizer has (transformers' tokenizer classes default to those)."""
    for file in (st_folder.TOKENIZER_CONFIG, st_folder.SPECIAL_TOKENS_MAP):
        named = st_folder.special_tokens(path / file).get(role)
        if named is not None and tokenizer.token_to_id(named) is not None:
            return tokenizer.token_to_id(named)
    return next((tokenizer.token_to_id(t) for t in _CONVENTIONAL[role] if tokenizer.token_to_id(t) is not None),
                None)


def _skiplist_ids(tokenizer: Tokenizer, words: Iterable[str]) -> tuple[int, ...]:
    """The skiplist words' ids, in order; a word that is not one token of the vocabulary is left out
    (sentence-transformers drops what resolves to the unknown token, lest every unknown token be skipped)."""
    found = [tokenizer.token_to_id(word) for word in words]
    return tuple(i for i in found if i is not None)


def _markers_to_register(tokenizer: Tokenizer, markers: Iterable[str]) -> tuple[str, ...]:
    """The legacy markers sentence-transformers adds as special tokens: a marker (the whole value, else its
    first word) the tokenizer knows but does not emit as one piece.  Text put in front of a text would
    otherwise break ``[unused0]`` into pieces, where the model was trained on the one token."""
    plain = Tokenizer.from_str(tokenizer.to_str())
    plain.no_truncation()
    plain.no_padding()
    known = plain.get_vocab(with_added_tokens=True)
    found: list[str] = []
    for value in markers:
        if not value or not value.split():
            continue
        for marker in (value, value.split(None, 1)[0]):
            if marker not in known:
                continue
            if plain.encode(marker, add_special_tokens=False).tokens != [marker]:
                found.append(marker)
            break
    return tuple(dict.fromkeys(found))


def add_markers(tokenizer: Tokenizer, config: MultiVectorConfig) -> Tokenizer:
    """``tokenizer`` (changed in place) with the markers ``config`` lists as special tokens, matched before
    normalisation, as sentence-transformers registers them: save it as the served tokenizer.json."""
    if config.added_special_tokens:
        tokenizer.add_special_tokens([AddedToken(marker, normalized=False, special=True)
                                      for marker in config.added_special_tokens])
    return tokenizer


def multi_vectors(hidden: np.ndarray, score_mask: np.ndarray, config: MultiVectorConfig) -> list[np.ndarray]:
    """The reference head: each text's token vectors (``hidden``: the encoder's ``[batch, seq, hidden]``
    states) through the Dense modules, normalised where the model normalises, kept where ``score_mask``
    (``[batch, seq]``) is set, in order."""
    vectors = hidden.astype(np.float32)
    for module in config.dense:
        vectors = module(vectors)
    if config.normalize:
        vectors = l2_normalize(vectors)
    return [row[mask.astype(bool)] for row, mask in zip(vectors, score_mask[:, : vectors.shape[1]])]
