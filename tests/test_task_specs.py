"""Every registered task spec is complete, and every layer reads the same facts from it."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from nexus_sli.client.error_codes import TOKEN_COUNT_OUTPUT
from nexus_sli.exporter.triton import config as tc
from nexus_sli.exporter.triton.python_models.encoding import TOKENIZER_MODES
from nexus_sli.exporter.triton.python_models.heads import HEADS
from nexus_sli.tasks import TASKS, TaskError, get_task, infer_task, register
from nexus_sli.tasks.agreement import METRICS

NAMES = list(TASKS)


def test_the_served_tasks_are_registered_in_order():
    assert NAMES == ["embedding", "classification", "rerank", "token-classification", "question-answering",
                     "sparse-embedding", "multi-vector", "bge-m3"]


def test_heads_and_specs_match_one_to_one():
    assert sorted(spec.head for spec in TASKS.values()) == sorted(HEADS)


@pytest.mark.parametrize("name", NAMES)
def test_a_spec_names_what_every_layer_needs(name):
    spec = get_task(name)
    assert spec.tokenizer_mode in TOKENIZER_MODES
    # embeddings, dense and sparse, are judged by cosine, and only they pool in the graph
    assert spec.agreement in METRICS or (spec.agreement is None and spec.pooled_by is not None)
    assert spec.client_output in {t.name for t in spec.results}
    assert callable(spec.parse) and spec.output_names()
    known = {t.name for t in (*spec.inputs, *spec.token_extras, *spec.encoder_outputs)} | {"attention_mask"}
    assert set(spec.post_inputs) <= known, f"post-processing reads tensors no step makes: {set(spec.post_inputs) - known}"


@pytest.mark.parametrize("name", NAMES)
def test_the_ensemble_config_carries_the_spec_tensors(name):
    spec = get_task(name)
    lay = tc.layout(name, ["input_ids", "attention_mask"], 16, 3, vocab_size=50)
    steps = ("t", "e", "p")
    ensemble = tc.ensemble_config("m", name, lay, ["input_ids", "attention_mask"], steps, {})
    assert [i.name for i in ensemble.input] == [t.name for t in spec.inputs]
    # a task that reports usage answers each text's token count after its results, from the tokenizer step
    counted = [TOKEN_COUNT_OUTPUT] if spec.usage else []
    assert [o.name for o in ensemble.output] == [t.name for t in spec.results] + counted
    assert [n for n in ensemble.ensemble_scheduling.step[0].output_map if n == TOKEN_COUNT_OUTPUT] == counted
    tokenizer = tc.tokenizer_config("t", lay, 128, 0, True)
    assert [o.name for o in tokenizer.output if o.name == TOKEN_COUNT_OUTPUT] == counted
    assert ensemble.parameters["task"].string_value == name
    assert (ensemble.max_batch_size > 0) == spec.batched
    encoder = tc.encoder_config("e", lay, ["input_ids", "attention_mask"], tc.EncoderServing(platform="onnxruntime_onnx"))
    assert [o.name for o in encoder.output] == spec.output_names()
    assert dict(ensemble.ensemble_scheduling.step[2].input_map).keys() == set(spec.post_inputs)


def test_symbolic_dims_resolve_to_the_model_sizes():
    lay = tc.layout("embedding", ["input_ids"], 384, 0)
    assert lay.outputs[0].dims == (384,) and lay.encoder_outputs[0].dims == (-1, 384)
    assert tc.layout("classification", ["input_ids"], 384, 7).outputs[0].dims == (7,)
    sparse = tc.layout("sparse-embedding", ["input_ids"], 384, 0, vocab_size=30522)
    assert sparse.outputs[0].dims == (30522,) and sparse.encoder_outputs[0].dims == (-1, 30522)
    pooled = tc.layout("sparse-embedding", ["input_ids"], 384, 0, pooled=True, vocab_size=30522)
    assert [(t.name, t.dims) for t in pooled.encoder_outputs] == [("SPARSE_EMBEDDING", (30522,))]


def arch(*architectures, num_labels=2):
    return SimpleNamespace(architectures=list(architectures), num_labels=num_labels)


def test_the_task_is_inferred_from_the_architecture():
    assert infer_task(arch("BertModel")).name == "embedding"
    assert infer_task(arch()).name == "embedding"
    assert infer_task(arch("BertForSequenceClassification", num_labels=3)).name == "classification"
    assert infer_task(arch("XLMRobertaForSequenceClassification", num_labels=1)).name == "rerank"
    assert infer_task(arch("DebertaV2ForTokenClassification")).name == "token-classification"
    assert infer_task(arch("BertForQuestionAnswering")).name == "question-answering"
    # a masked-LM checkpoint alone is exported for dense embeddings (SparseEncoder folders say sparse)
    assert infer_task(arch("BertForMaskedLM")).name == "embedding"


def test_unknown_and_duplicate_tasks_are_refused_with_the_known_names():
    with pytest.raises(TaskError, match="known tasks: embedding, classification, rerank"):
        get_task("summarization")
    with pytest.raises(TaskError, match="registered twice"):
        register(get_task("rerank"))


def test_post_processing_parameters_come_from_the_spec():
    config = SimpleNamespace(id2label={0: "neg", 1: "pos"}, problem_type="multi_label_classification")
    assert get_task("classification").post_params(config, None) == {"id2label": '{"0": "neg", "1": "pos"}',
                                                                     "multi_label": "true",
                                                                     "function_to_apply": "sigmoid"}
    embedder = SimpleNamespace(pooling="cls", normalize=False)
    assert get_task("embedding").post_params(config, embedder) == {"pooling": "cls", "normalize": "false"}


def test_each_head_turns_encoder_outputs_into_the_spec_results():
    logits = np.array([[0.0, 2.0, 1.0]], np.float32)
    scores = HEADS["classification"]({"logits": logits}, {"multi_label": "false"})["SCORES"]
    labels = get_task("classification").parse([scores], {1: "pos"}, top_k=2)
    assert [label.label for label in labels[0]] == ["pos", "2"] and labels[0][0].score > labels[0][1].score
    ranked = get_task("rerank").parse([HEADS["rerank"]({"logits": np.array([[0.0], [3.0]])}, {})["SCORES"]],
                                      ["a", "b"], None)
    assert [r.document for r in ranked] == ["b", "a"]
    # SPLADE: padding never counts, negative logits are inactive, log(1 + relu) of the max over real tokens
    logits = np.array([[[1.0, -2.0, 0.5], [3.0, -1.0, 0.0], [9.0, 9.0, 9.0]]], np.float32)
    params = {"splade_pooling": "max", "splade_activation": "relu"}
    sparse = HEADS["sparse-embedding"]({"logits": logits, "attention_mask": np.array([[1, 1, 0]])}, params)
    np.testing.assert_allclose(sparse["SPARSE_EMBEDDING"], np.log1p([[3.0, 0.0, 0.5]]), rtol=1e-6)
