"""A GPU export served here, on the CPU, only when asked: the repository keeps KIND_GPU.

Triton refuses KIND_GPU models without a GPU, so ``--gpu-models-on-cpu`` serves a
logged shadow of the repository; the fp16 graph runs on ONNX Runtime's CPU
provider and must still answer like sentence-transformers, with concurrent requests
merged: on ``nexus-sli serve``'s default path the ensemble's steps run in one process,
as they do on a GPU, and with the steps separate (an NGC container) the encoder merges
the requests of one length bucket.
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from sentence_transformers import SentenceTransformer

from helpers.servers import serving
from helpers.serving_paths import JOINED, PATHS, joined_models, per_path, start_options
from helpers.waiting import wait_until
from nexus_sli.client import EncoderClient
from nexus_sli.exporter.errors import NexusError
from nexus_sli.exporter.export.source import resolve_model
from nexus_sli.exporter.export.validate import validation_texts
from nexus_sli.exporter.serving import gpu_on_cpu, server as serve, temporary_folders
from nexus_sli.exporter.triton import config as tc

from nexus_sli.bench.served import free_ports as _free_ports

NAME = "minilm_gpu"
pytestmark = pytest.mark.skipif(gpu_on_cpu.gpu_visible(), reason="a GPU is visible: the CPU override is not used")


@pytest.fixture(scope="module")
def repo(tmp_path_factory, exports):
    return exports.copy(NAME, tmp_path_factory.mktemp("gpu-repo"))  # device gpu, backend and precision auto


@pytest.fixture(scope="module")
def servers(repo, tmp_path_factory):
    @contextlib.contextmanager
    def start(path):
        log = tmp_path_factory.mktemp(f"gpu-serve-log-{path}") / "tritonserver.log"
        with open(log, "w") as sink:  # the server's output, where the backend shim logs its providers
            with serving(repo, gpu_on_cpu=True, stdout=sink, stderr=subprocess.STDOUT,
                         **start_options(path)) as server:
                yield {**server, "log": log, "path": path}

    with per_path(start) as server:
        yield server


@pytest.fixture(params=PATHS)
def served(request, servers):
    return servers(request.param)


def test_gpu_models_are_refused_here_unless_asked(repo):
    with pytest.raises(NexusError, match=f"{NAME}_encoder ask for a GPU .* --gpu-models-on-cpu"):
        serve.start(repo, *_free_ports(3))


def test_the_override_is_logged_and_the_repository_keeps_kind_gpu(repo, caplog):
    with caplog.at_level(logging.WARNING, logger=gpu_on_cpu.__name__):
        shadow = gpu_on_cpu.servable(repo, gpu_on_cpu=True)
    assert f"serving {NAME}_encoder on the CPU" in caplog.text
    on_disk = tc.read(repo / f"{NAME}_encoder" / "config.pbtxt")
    served = tc.read(shadow / f"{NAME}_encoder" / "config.pbtxt")
    assert on_disk.instance_group[0].kind == tc.pb.ModelInstanceGroup.KIND_GPU
    assert served.instance_group[0].kind == tc.pb.ModelInstanceGroup.KIND_CPU
    assert not served.optimization.execution_accelerators.gpu_execution_accelerator
    assert (shadow / f"{NAME}_encoder" / "1").resolve() == (repo / f"{NAME}_encoder" / "1").resolve()
    temporary_folders.remove(shadow)


@pytest.mark.parametrize("served", [JOINED], indirect=True)
def test_the_default_path_joins_the_gpu_ensembles_steps_as_on_a_gpu(served):
    assert joined_models(served["http"], [NAME]) == {NAME}


@pytest.mark.parametrize("served", [JOINED], indirect=True)
def test_the_backend_shim_logs_the_cpu_provider_it_runs_the_gpu_model_on(served):
    log = served["log"].read_text()
    assert f"nexus-sli onnxruntime backend, {NAME}_encoder: instance kind KIND_CPU: CPUExecutionProvider" in log
    assert f"nexus-sli onnxruntime backend, {NAME}_encoder: session providers ['CPUExecutionProvider']" in log


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_served_fp16_embeddings_match_sentence_transformers(served, protocol):
    texts = validation_texts()[:48]
    reference = SentenceTransformer(str(resolve_model(None).path), device="cpu").encode(texts)
    with EncoderClient(served[protocol], protocol=protocol, model=NAME) as client:
        got = client.embed(texts)
    cosines = np.sum(got * reference, axis=1) / np.linalg.norm(got, axis=1) / np.linalg.norm(reference, axis=1)
    assert got.shape == (48, 384) and cosines.min() >= 0.999, cosines.min()


def test_concurrent_requests_are_merged(served):
    """Joined, one execution takes every text waiting (raw strings batch freely); separate, the encoder's
    batcher merges the requests of one length bucket."""
    stats = grpcclient.InferenceServerClient(served["grpc"])
    counted = NAME if served["path"] == JOINED else f"{NAME}_encoder"

    def counts():
        model = stats.get_inference_statistics(counted, as_json=True)["model_stats"][0]
        return int(model.get("inference_count", 0)), int(model.get("execution_count", 0))  # JSON leaves out zeros

    texts = [f"short text number {i}" for i in range(16)]  # all within the 16-token bucket
    clients = [EncoderClient(served["grpc"], model=NAME) for _ in texts]
    barrier = threading.Barrier(len(texts))

    def send(index):
        barrier.wait()
        return clients[index].embed(texts[index])

    before = counts()
    with ThreadPoolExecutor(len(texts)) as pool:
        vectors = list(pool.map(send, range(len(texts))))
    # the encoder is the ensemble's last step: Triton may answer before it has counted the execution
    def all_counted():
        now = counts()
        return now if now[0] - before[0] >= len(texts) else None

    after = wait_until(all_counted, f"{counted}'s statistics to count every request", timeout=30)
    inferences, executions = after[0] - before[0], after[1] - before[1]
    assert inferences == 16 and executions < inferences, f"{executions} executions for {inferences} requests"
    assert np.allclose(vectors[3], clients[0].embed(texts[3]), atol=1e-5)  # merged rows answer their own text
