"""Every family: walk, export, and parity-check a seeded tiny checkpoint."""

from __future__ import annotations

import onnx
import pytest

from nexus_sli.exporter.export import export_report
from nexus_sli.exporter.export.pipeline import ExportOptions, run_export
from nexus_sli.exporter.export.families import FAMILIES, normalize_model_type
from helpers.tiny_models import NO_TINY_MODEL, TINY_CONFIGS
from helpers.tiny_remote_models import REMOTE_TINY

NO_SEGMENT_INPUT = {"distilbert", "modernbert", "deberta", "deberta-v2", "mpnet", "eurobert"}


def test_every_registered_family_has_a_tiny_model_or_a_named_reason():
    with_model = {normalize_model_type(t) for t in TINY_CONFIGS} | set(REMOTE_TINY)
    excused = {family for family, reason in NO_TINY_MODEL.items() if reason.strip()}
    assert set(NO_TINY_MODEL) == excused, "every family without a tiny model needs a reason"
    missing = set(FAMILIES) - with_model - excused
    assert not missing, f"registered families with neither a tiny model nor a reason: {sorted(missing)}"
    assert with_model | excused == set(FAMILIES), "tiny models of families nobody registered"


@pytest.mark.parametrize("model_type", sorted(TINY_CONFIGS))
def test_family_exports_and_matches_pytorch(model_type, tiny_checkpoint, tmp_path):
    result = run_export(ExportOptions(model=str(tiny_checkpoint(model_type)), name="tiny", out=tmp_path / "repo"))
    encoder = tmp_path / "repo" / "tiny_encoder"
    report = export_report.read(encoder)
    assert report.validation.passed is True and result.report == report
    assert report.validation.max_abs_diff <= 1e-4
    assert report.validation.cosine_min > 0.9999
    graph = onnx.load(str(encoder / "1" / "model.onnx")).graph
    inputs = [i.name for i in graph.input]
    assert inputs[:2] == ["input_ids", "attention_mask"]
    assert ("token_type_ids" in inputs) == (model_type not in NO_SEGMENT_INPUT)
    for tensor in graph.input:  # batch and sequence stay dynamic
        assert [d.dim_param for d in tensor.type.tensor_type.shape.dim] == ["batch", "sequence"]


def test_eurobert_classification_exports_and_matches_pytorch(tiny_tokenizer, tmp_path):
    """EuroBERT's classification head is transformers' own (``classifier_pooling`` ``late``, the default: a
    dense layer, its activation and the classifier on every token, then the logits' mean over the text's
    tokens): the walk loads ``model.`` and the head, and the exported graph pools as PyTorch does whatever
    the padding."""
    import torch
    from transformers import CONFIG_MAPPING, EuroBertForSequenceClassification

    from helpers.tiny_models import COMMON, TINY_CONFIGS

    labels = {str(i): f"LABEL_{i}" for i in range(3)}
    config = CONFIG_MAPPING["eurobert"](**{**COMMON, **TINY_CONFIGS["eurobert"][1]}, id2label=labels,
                                        label2id={v: int(k) for k, v in labels.items()})
    config.architectures = ["EuroBertForSequenceClassification"]
    torch.manual_seed(0)
    EuroBertForSequenceClassification(config).eval().save_pretrained(tmp_path / "ckpt", safe_serialization=True)
    tiny_tokenizer.save(str(tmp_path / "ckpt" / "tokenizer.json"))
    run_export(ExportOptions(model=str(tmp_path / "ckpt"), task="classification", name="tiny", out=tmp_path / "repo"))
    report = export_report.read(tmp_path / "repo" / "tiny_encoder")
    assert report.model_type == "eurobert" and report.task == "classification"
    assert report.validation.passed and report.validation.max_abs_diff <= 1e-4
