"""The models of one export: NAME_tokenizer, NAME_encoder, NAME_postprocess, NAME.

An embedding export whose encoder graph pools (:mod:`export.pooling`) has no
NAME_postprocess: its ensemble is NAME_tokenizer -> NAME_encoder.  Where that
graph keeps its token states (an embedding's), a second ensemble NAME_tokens
(NAME_tokenizer -> the same NAME_encoder) serves them, and NAME's parameter
``token_model`` names it.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from nexus_sli.tasks import get_task
from nexus_sli.tasks.model_parameters import BACKEND, EMBEDDING_MODEL, HEAD, PRECISION, TASK, TOKEN_MODEL, Prompts, write
from nexus_sli.tasks.spec import TOKEN_MODEL_SUFFIX

from . import config as tc

_PYTHON_MODELS = "nexus_sli.exporter.triton.python_models"
#: Copied beside each python step (and each encoder shim, ``serving/backend_folders.py``), from the packages
#: below the exporter, as (package, file): on a Triton server nexus-sli is not installed.
SHARED_FILES = (
    ("nexus_sli.client", "error_codes.py"),       # the error codes the client understands, emitted by the steps
    ("nexus_sli.tasks", "model_parameters.py"),   # the keys of the configs' parameters, read by the steps
)

REPOSITORY_README = """\
# Triton model repository written by nexus-sli

Each model `NAME` is an ensemble: raw strings in (TYPE_STRING), the task's
answer out (`parameters {{ task: ... }}` in its config says which task).
It chains `NAME_tokenizer` (python backend, `tokenizers`), `NAME_encoder`
(`onnxruntime_onnx`, or the `openvino` backend where the export chose
OpenVINO; its `validation.json` says which) and `NAME_postprocess` (python backend, numpy). An
embedding model has no `NAME_postprocess`: its encoder graph ends in the
pooling and normalisation and answers `EMBEDDING` itself (the ensemble answers
`TOKEN_COUNT` too, each text's tokens, from `NAME_tokenizer`); beside it, the
ensemble `NAME_tokens` (`NAME_tokenizer` -> the same `NAME_encoder`) answers
each token's vector, `TOKEN_EMBEDDINGS`, with the tokenizer's `ATTENTION_MASK`.
A sparse-embedding model's encoder answers `SPARSE_EMBEDDING` ([vocab]) itself.
A multi-vector (ColBERT) model's encoder answers `MULTI_VECTOR`, one vector per
token, zeros where a token is not scored; the ensemble answers `SCORE_MASK`
beside it, from `NAME_tokenizer` (request parameter `input_type`: `query` or
`document`, the default), and a text's vectors are the rows its mask holds.

Serve it with `tritonserver --model-repository <this folder>`; locally,
`nexus-sli serve --model-repository <this folder>` starts the Triton server
from the `nvidia-pytriton` wheel with Python-based onnxruntime and openvino backends.

## The server's Python needs `tokenizers` and `numpy`

The python-backend models import `tokenizers` and `numpy` (the files they need
besides are copied next to each `model.py`). On an NGC Triton container the
python backend's interpreter lacks `tokenizers`; provide it with either

    pip install tokenizers "numpy<2"      # inside the container, before starting

(numpy<2: Triton 2.51's python backend crashed on string inputs with numpy 2),
or build the image of nexus-sli's `deploy/docker/Dockerfile`, which does this;
or a packed environment: build one with conda-pack holding `tokenizers` and
`numpy`, and add to both python models' config.pbtxt

    parameters: {{ key: "EXECUTION_ENV_PATH", value: {{ string_value: "$$TRITON_MODEL_DIRECTORY/env.tar.gz" }} }}

Locally (`nexus-sli serve`) the stub runs with the project's virtual
environment on its path, where both are installed.
"""


@dataclass(frozen=True)
class ServingFacts:
    """What the served models need to know about the exported encoder."""

    input_names: list[str]
    hidden_size: int
    num_labels: int
    max_length: int
    pad_id: int
    truncate: bool
    #: postprocess parameters (pooling, normalize, id2label, multi_label ...)
    post_params: dict = field(default_factory=dict)
    #: how the encoder is served (the runtime target's platform or backend, parameters, device)
    encoder: tc.EncoderServing = field(default_factory=lambda: tc.EncoderServing(platform="onnxruntime_onnx"))
    model_filename: str = "model.onnx"
    #: the encoder graph ends in the pooling and answers the embedding: no post-processing model
    pooled: bool = False
    #: the model's named prompts, which the tokenizer step applies and the ensembles describe to clients
    prompts: Prompts = field(default_factory=Prompts)
    #: more ensemble parameters for clients (``matryoshka_dims``: the sizes the model was trained for)
    described: dict = field(default_factory=dict)
    #: the masked-LM head's output size (sparse embeddings' dims; 0 where no tensor has it)
    vocab_size: int = 0
    #: the served embedding's size where the model's Dense modules project it (0: the hidden size)
    embedded_size: int = 0
    #: the precision the served encoder was exported in (``fp32``, ``fp16``, ``int8`` ...), for clients
    precision: str = ""
    #: the runtime target serving the encoder (``onnxruntime``, ``openvino`` ...), for clients
    backend: str = ""
    #: a late-interaction model's two sides (``python_models/sides.py``'s ``Sides``), which its ``sided``
    #: tokenizer step reads; None for other tasks
    sides: Any = None


def _copy_python_model(module: str, target: Path, extra: dict[str, Path] | None = None) -> None:
    version = target / "1"
    version.mkdir(parents=True, exist_ok=True)
    package = resources.files(_PYTHON_MODELS)
    (version / "model.py").write_text(package.joinpath(f"{module}.py").read_text())
    for helper in ("encoding.py", "heads.py", "sides.py"):
        (version / helper).write_text(package.joinpath(helper).read_text())
    for shared, file in SHARED_FILES:
        (version / file).write_text(resources.files(shared).joinpath(file).read_text())
    for name, source in (extra or {}).items():
        shutil.copyfile(source, version / name)


def write_models(root: Path, name: str, task: str, facts: ServingFacts, tokenizer_json: Path) -> list[str]:
    """Write every file of the ensemble(s) except the encoder's model file(s) under ``1/``; return the
    ensembles' names (``NAME``, and ``NAME_tokens`` where the encoder keeps its token states)."""
    lay = tc.layout(task, facts.input_names, facts.hidden_size, facts.num_labels, facts.pooled, facts.vocab_size,
                    facts.embedded_size)
    tokenizer, encoder, postprocess = f"{name}_tokenizer", f"{name}_encoder", f"{name}_postprocess"
    steps = (tokenizer, encoder) if lay.encoder_answers else (tokenizer, encoder, postprocess)
    _copy_python_model("tokenizer_model", root / tokenizer, {"tokenizer.json": tokenizer_json})
    sides = facts.sides.to_json() if facts.sides is not None else None
    rows = facts.encoder.max_batch_size  # every step of the repository merges as many rows as the encoder
    tc.write(tc.tokenizer_config(tokenizer, lay, facts.max_length, facts.pad_id, facts.truncate,
                                 facts.encoder.widths(facts.max_length), facts.prompts, sides, rows), root / tokenizer)
    (root / encoder / "1").mkdir(parents=True, exist_ok=True)
    tc.write(tc.encoder_config(encoder, lay, facts.input_names, facts.encoder, facts.model_filename,
                               facts.max_length), root / encoder)
    if not lay.encoder_answers:
        _copy_python_model("postprocess_model", root / postprocess)
        head = write({TASK: task, HEAD: get_task(task).head})
        tc.write(tc.postprocess_config(postprocess, lay, {**head, **facts.post_params}, rows), root / postprocess)
    tokens = name + TOKEN_MODEL_SUFFIX if lay.token_states is not None else None
    described = {**facts.described, **write({TOKEN_MODEL: tokens, PRECISION: facts.precision or None,
                                                BACKEND: facts.backend or None})}
    prompts = facts.prompts.write()
    _write_ensemble(root, tc.ensemble_config(name, task, lay, facts.input_names, steps,
                                             {**facts.post_params, **prompts, **described}, rows))
    if tokens:  # the same prompts: a token request is tokenised as an embedding request is
        _write_ensemble(root, tc.token_ensemble_config(tokens, lay, facts.input_names, (tokenizer, encoder),
                                                       {**prompts, **write({EMBEDDING_MODEL: name})}, rows))
    return [name, *([tokens] if tokens else [])]


def _write_ensemble(root: Path, config) -> None:
    (root / config.name / "1").mkdir(parents=True, exist_ok=True)  # Triton wants a version folder, even for ensembles
    tc.write(config, root / config.name)


def write_readme(out: Path) -> None:
    (out / "README.md").write_text(REPOSITORY_README.format())
