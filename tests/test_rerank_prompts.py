"""A CrossEncoder saved with prompts is served as ``CrossEncoder.predict`` scores it: its default prompt, else
the request's ``prompt_name``, in front of each pair's query.  The export runs here in the test's process: its
tokenizer step as Triton's python backend loads it, its encoder's graph on ONNX Runtime, then the rerank head."""

from __future__ import annotations

import json
import warnings

import numpy as np
import onnxruntime as ort
import pytest
import torch
from transformers import PreTrainedTokenizerFast

from conftest import TINY_TOKENIZER
from helpers.python_steps import load_step, unload
from nexus_sli.bench.joined_profile import Tensor
from nexus_sli.exporter.export.pipeline import ExportOptions, run_export
from nexus_sli.exporter.export.source import load_config
from nexus_sli.exporter.serving.joined_steps import triton_json
from nexus_sli.exporter.triton import config as tc
from nexus_sli.exporter.triton.python_models.heads import HEADS
from nexus_sli.tasks import get_task
from test_task_heads import _classifier

NAME = "prompted_reranker"
PROMPTS = {"web": "web search: ", "title": "title: "}
QUERY = "what did they find"
DOCUMENTS = ["it was water, in the cellar", "a plan", "they start after the first year"]
PAIRS = [(QUERY, document) for document in DOCUMENTS]


class PairRequest:
    """The parts of a rerank request the tokenizer step reads: ``QUERY``, ``DOCUMENTS`` and its parameters."""

    def __init__(self, query: str, documents: list[str], **parameters):
        self._inputs = [Tensor("QUERY", np.array([query.encode()], dtype=object)),
                        Tensor("DOCUMENTS", np.array([d.encode() for d in documents], dtype=object))]
        self._parameters = json.dumps(parameters)

    def inputs(self):
        return self._inputs

    def parameters(self):
        return self._parameters

    def requested_output_names(self):
        return []


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    """A seeded one-label CrossEncoder (logits as scores) saved with two prompts, ``web`` the default."""
    from sentence_transformers import CrossEncoder

    root = tmp_path_factory.mktemp("prompted-reranker")
    model = _classifier(1)
    with torch.no_grad():  # logits far enough apart that a prompt's effect is past the test's tolerance
        model.classifier.weight.mul_(50)
    model.save_pretrained(root / "base")
    # BERT's segment ids, as a BERT cross-encoder's tokenizer gives them and the exported step does
    PreTrainedTokenizerFast(tokenizer_file=str(TINY_TOKENIZER), unk_token="[UNK]", cls_token="[CLS]",
                            sep_token="[SEP]", pad_token="[PAD]", mask_token="[MASK]",
                            model_input_names=["input_ids", "token_type_ids", "attention_mask"]
                            ).save_pretrained(root / "base")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        CrossEncoder(str(root / "base"), device="cpu", activation_fn=torch.nn.Identity(), prompts=PROMPTS,
                     default_prompt_name="web").save(str(root / "ce"))
        return CrossEncoder(str(root / "ce"), device="cpu"), root / "ce"


@pytest.fixture(scope="module")
def repository(cross_encoder, tmp_path_factory):
    repo = tmp_path_factory.mktemp("prompted-reranker-repo")
    run_export(ExportOptions(model=str(cross_encoder[1]), name=NAME, out=repo))
    return repo


@pytest.fixture
def served(repository, cross_encoder, monkeypatch):
    """``served(**parameters)``: (the tokenizer step's answer, the scores) for :data:`PAIRS`."""
    folder = repository / f"{NAME}_tokenizer"
    config = triton_json(tc.read(folder / "config.pbtxt"))
    step = load_step(monkeypatch, folder / "1", f"{NAME}_tokenizer_model", config, folder)
    session = ort.InferenceSession(str(repository / f"{NAME}_encoder" / "1" / "model.onnx"),
                                   providers=["CPUExecutionProvider"])
    params = get_task("rerank").post_params(load_config(cross_encoder[1]), None)

    def serve(**parameters):
        (answer,) = step.execute([PairRequest(QUERY, DOCUMENTS, **parameters)])
        if answer.error is not None:
            return answer, None
        outputs = session.run(None, {i.name: answer.tensors[i.name] for i in session.get_inputs()})
        named = {o.name: value for o, value in zip(session.get_outputs(), outputs)}
        return answer, HEADS["rerank"](named, params)["SCORES"]

    yield serve
    unload()


@pytest.mark.parametrize("prompt_name", [None, "title"])
def test_a_cross_encoders_prompt_goes_in_front_of_each_query_as_predict_puts_it(cross_encoder, served, prompt_name):
    model, _ = cross_encoder
    answer, scores = served(**({"prompt_name": prompt_name} if prompt_name else {}))
    assert answer.error is None
    prompted = [(PROMPTS[prompt_name or "web"] + query, document) for query, document in PAIRS]
    expected_ids = model.preprocess(prompted)["input_ids"].tolist()
    mask = answer.tensors["attention_mask"]
    assert [row[:int(m.sum())].tolist() for row, m in zip(answer.tensors["input_ids"], mask)] == \
        [[i for i in row if i != model.tokenizer.pad_token_id] for row in expected_ids]
    expected = model.predict(PAIRS, prompt_name=prompt_name)  # None: the default prompt, as served
    np.testing.assert_allclose(scores, expected, rtol=1e-4, atol=1e-5)
    # the prompt moves the scores: a test that could not tell them apart would prove nothing
    assert np.abs(model.predict(PAIRS, prompt="") - expected).max() > 1e-3


def test_an_unknown_prompt_name_is_refused_with_the_cross_encoders_prompts(served):
    answer, _ = served(prompt_name="instruction")
    assert "unknown prompt_name 'instruction'; this model's prompts: 'title', 'web'" in answer.error

