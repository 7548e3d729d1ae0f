"""``nexus-sli publish`` to a real S3-compatible server (SeaweedFS on loopback), and the real
``tritonserver`` serving from it: checksums, new version folders, a failed publish that
leaves the published version serving, dry runs (with --prune, the folders it deletes), files an older export left
beside a config, credentials that are never printed, and the Kubernetes Deployment's own tritonserver arguments
run against the store."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as pb

from helpers.servers import end_now
from helpers.waiting import wait_until
from helpers import object_store
from nexus_sli.cli.main import main
from nexus_sli.client import EncoderClient
from nexus_sli.exporter.export.pipeline import ExportOptions, run_export
from nexus_sli.exporter.serving import server as serve
from nexus_sli.exporter.triton import publish as pub

BUCKET = "models"
#: the embedding ensemble's models: its encoder graph pools, so there is no post-processing step; the
#: token-embedding ensemble shares its steps, so both are published in one group
STEPS = ("embedder_tokenizer", "embedder_encoder")
MODELS = (*STEPS, "embedder", "embedder_tokens")
TEXTS = ["the first text", "another one, a little longer than the first", "short", "ünïcödé text ✓"]


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    with object_store.serving(tmp_path_factory.mktemp("s3"), BUCKET) as server:
        yield server


@pytest.fixture(scope="module")
def exports(tmp_path_factory, tiny_tokenizer):
    """Two exports of one model name: version "a" and a retrained "b" (other weights)."""
    from helpers.tiny_models import build_tiny

    root = tmp_path_factory.mktemp("publish")
    made = {}
    for label, seed in (("a", 0), ("b", 1)):
        checkpoint = build_tiny("bert", root / f"checkpoint_{label}", tiny_tokenizer, seed=seed)
        run_export(ExportOptions(model=str(checkpoint), name="embedder", out=root / f"repo_{label}"))
        made[label] = {"repo": root / f"repo_{label}", "reference": object_store.torch_embeddings(checkpoint, TEXTS)}
    return made


def _destination(s3, prefix: str) -> pub.Destination:
    return pub.Destination.parse(f"s3://{BUCKET}/{prefix}", s3.endpoint)


def _keys(s3, prefix: str) -> set[str]:
    pages = s3.client().get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix + "/")
    return {item["Key"] for page in pages for item in page.get("Contents", [])}


def _config(s3, prefix: str, model: str) -> pb.ModelConfig:
    body = s3.client().get_object(Bucket=BUCKET, Key=f"{prefix}/{model}/config.pbtxt")["Body"].read()
    return text_format.Parse(body.decode(), pb.ModelConfig())


def _configs_bytes(s3, prefix: str) -> dict[str, bytes]:
    return {m: s3.client().get_object(Bucket=BUCKET, Key=f"{prefix}/{m}/config.pbtxt")["Body"].read() for m in MODELS}


def test_destinations_parse_as_triton_names_them():
    assert pub.Destination.parse("s3://bucket/a/b/") == pub.Destination("bucket", "a/b", None)
    assert pub.Destination.parse("s3://10.0.0.5:9000/bucket/repo") == pub.Destination("bucket", "repo",
                                                                                      "http://10.0.0.5:9000")
    assert pub.Destination.parse("s3://https://store:443/bucket") == pub.Destination("bucket", "", "https://store:443")
    assert pub.Destination.parse("s3://b/p", "http://x:1").endpoint_url == "http://x:1"
    assert pub.Destination.parse("s3://x:1/b/p", "http://x:1/").endpoint_url == "http://x:1"  # the same store twice
    with pytest.raises(pub.PublishError, match="names the store http://x:1 and --endpoint-url http://y:2"):
        pub.Destination.parse("s3://x:1/b/p", "http://y:2")
    with pytest.raises(pub.PublishError, match="without its port"):  # else "store.example" would be the bucket
        pub.Destination.parse("s3://https://store.example/bucket/prefix")
    for bad in ("/local/folder", "s3://", "gs://bucket/p"):
        with pytest.raises(pub.PublishError):
            pub.Destination.parse(bad)


def test_dry_run_lists_every_file_and_writes_nothing(s3, exports, capsys):
    code = main(["publish", "--repository", str(exports["a"]["repo"]), "--to", f"s3://{BUCKET}/dry",
                 "--endpoint-url", s3.endpoint, "--dry-run"])
    out = capsys.readouterr().out
    assert code == 0 and _keys(s3, "dry") == set()
    assert "new version 1" in out and "dry/embedder_encoder/1/model.onnx" in out
    assert "dry/embedder/1/" in out  # the ensemble's empty version folder needs an object on S3
    for model in MODELS:
        assert f"dry/{model}/config.pbtxt: serves version 1" in out


def test_publish_uploads_verified_files_and_pins_the_version(s3, exports):
    repo = exports["a"]["repo"]
    plan = pub.publish(repo, _destination(s3, "pinned"))
    assert [g.version for g in plan.groups] == [1]
    local = pub.read_local(repo)
    client = s3.client()
    for name, model in local.items():
        for rel, sha in model.files.items():
            head = client.head_object(Bucket=BUCKET, Key=f"pinned/{name}/1/{rel}", ChecksumMode="ENABLED")
            assert head["ChecksumSHA256"] == sha, (name, rel)
        config = _config(s3, "pinned", name)
        assert list(config.version_policy.specific.versions) == [1]
    assert [s.model_version for s in _config(s3, "pinned", "embedder").ensemble_scheduling.step] == [1, 1]
    # the same export again: nothing new, no version 2
    again = pub.publish(repo, _destination(s3, "pinned"))
    assert again.groups == [] and again.unchanged == {m: [1] for m in MODELS}
    assert not any("/2/" in key for key in _keys(s3, "pinned"))


def test_a_checksum_that_differs_after_upload_stops_the_publish_before_any_switch(s3, exports):
    pub.publish(exports["a"]["repo"], _destination(s3, "tampered"))
    before = _configs_bytes(s3, "tampered")
    client = s3.client()

    def tamper(key: str) -> None:  # another writer replaces the object between upload and verification
        if key.endswith("model.onnx"):
            client.put_object(Bucket=BUCKET, Key=key, Body=b"not the model")

    with pytest.raises(pub.PublishError, match="SHA-256"):
        pub.publish(exports["b"]["repo"], _destination(s3, "tampered"), after_upload=tamper)
    assert _configs_bytes(s3, "tampered") == before


def _embed(grpc_url: str) -> np.ndarray:
    with EncoderClient(grpc_url, model="embedder") as client:
        return client.embed(TEXTS)


def _serve(s3, prefix: str, log):
    http, grpc, metrics = object_store.free_ports(3)
    process = serve.start(s3.triton_url(BUCKET, prefix), http, grpc, metrics, stdout=log, stderr=log)
    return process, f"127.0.0.1:{grpc}"


def _extras(s3, prefix: str) -> bytes:
    return s3.client().get_object(Bucket=BUCKET, Key=f"{prefix}/embedder_encoder/validation.json")["Body"].read()


def test_a_failed_publish_leaves_the_published_version_serving(s3, exports, tmp_path):
    destination = _destination(s3, "prod")
    pub.publish(exports["a"]["repo"], destination)
    before, extras = _configs_bytes(s3, "prod"), _extras(s3, "prod")
    uploaded = []

    def fail_midway(key: str) -> None:
        uploaded.append(key)
        if len(uploaded) == 4:
            raise ConnectionError("network gone (injected)")

    with pytest.raises(ConnectionError):
        pub.publish(exports["b"]["repo"], destination, after_upload=fail_midway)
    assert _configs_bytes(s3, "prod") == before
    # the validation data beside the configs goes up after the switch: still the live export's
    assert _extras(s3, "prod") == extras
    assert any("/2/" in key for key in _keys(s3, "prod"))  # the partial version folder is there, unserved

    log = open(tmp_path / "server.log", "wb")
    process, grpc = _serve(s3, "prod", log)
    try:
        assert np.allclose(_embed(grpc), exports["a"]["reference"], atol=1e-4)
        # the supervisor finds the python-backend processes in Triton's local copies of the models
        counts = process.supervisor.stub_counts()
        assert counts.get("embedder_tokenizer") == 1

        plan = pub.plan_publish(exports["b"]["repo"], destination)
        assert plan.unreferenced == {"embedder_tokenizer": [2]}  # four of the tokenizer's five files got there
        assert [g.version for g in plan.groups] == [3]  # never reuses the interrupted folder's number
        pub.publish(exports["b"]["repo"], destination)
        # the steps keep the version the ensemble pinned until the next publish; the ensemble pins 3
        for step in STEPS:
            assert list(_config(s3, "prod", step).version_policy.specific.versions) == [1, 3]
        assert [s.model_version for s in _config(s3, "prod", "embedder").ensemble_scheduling.step] == [3, 3]
        assert _extras(s3, "prod") == (exports["b"]["repo"] / "embedder_encoder" / "validation.json").read_bytes()
        # the running server still serves what it loaded (nothing polls the store)
        assert np.allclose(_embed(grpc), exports["a"]["reference"], atol=1e-4)
        # a python-backend process killed after that publish: the supervisor loads every model again
        # from the store, the ensemble last, so the replica serves the new set whole, never a mix
        stub = process.supervisor.stub_processes()["embedder_tokenizer"][0]
        stub.send_signal(signal.SIGKILL)
        wait_until(lambda: process.supervisor.restarts, "the supervisor to reload the models", timeout=120)
        assert [model for _, model in process.supervisor.restarts] == ["embedder_tokenizer"]
        served = _embed(grpc)
        assert np.allclose(served, exports["b"]["reference"], atol=1e-4)
        assert not np.allclose(served, exports["a"]["reference"], atol=1e-2)
    finally:
        end_now(process)

    # a fresh server loads both step versions and the ensemble's pinned set: the new export
    process, grpc = _serve(s3, "prod", log)
    try:
        assert np.allclose(_embed(grpc), exports["b"]["reference"], atol=1e-4)
    finally:
        end_now(process)
        log.close()


def test_a_publish_stopped_while_switching_keeps_one_consistent_set_and_is_finished_next_time(s3, exports):
    destination = _destination(s3, "switching")
    pub.publish(exports["a"]["repo"], destination)

    def stop_before_the_ensemble(key: str) -> None:
        if key.endswith("embedder_encoder/config.pbtxt"):  # the last step's config
            raise KeyboardInterrupt  # killed between the steps' switch and the ensemble's

    with pytest.raises(KeyboardInterrupt):
        pub.publish(exports["b"]["repo"], destination, after_upload=stop_before_the_ensemble)
    # the steps serve both versions, the ensemble still pins the previous one: a starting server loads version 1
    for step in STEPS:
        assert list(_config(s3, "switching", step).version_policy.specific.versions) == [1, 2]
    ensemble = _config(s3, "switching", "embedder")
    assert list(ensemble.version_policy.specific.versions) == [1]
    assert [step.model_version for step in ensemble.ensemble_scheduling.step] == [1, 1]
    # the next publish sees the unfinished switch although every file is there, and finishes with a new
    # version; the steps keep the version the ensemble pinned (1), not the never-switched 2
    finished = pub.publish(exports["b"]["repo"], destination)
    assert [g.version for g in finished.groups] == [3] and "switching" in finished.groups[0].reason
    for step in STEPS:
        assert list(_config(s3, "switching", step).version_policy.specific.versions) == [1, 3]
    ensemble = _config(s3, "switching", "embedder")
    assert list(ensemble.version_policy.specific.versions) == [3]
    assert [step.model_version for step in ensemble.ensemble_scheduling.step] == [3, 3]
    assert pub.plan_publish(exports["b"]["repo"], destination).groups == []
    # the publish after that drops version 1: the steps serve the pinned 3 and the new 4; --prune then
    # deletes every version folder no config serves (servers copy a model's whole folder on load)
    done = pub.publish(exports["a"]["repo"], destination, prune=True)
    for step in STEPS:
        assert list(_config(s3, "switching", step).version_policy.specific.versions) == [3, 4]
    assert done.pruned == {"embedder_tokenizer": [1, 2], "embedder_encoder": [1, 2], "embedder": [1, 2, 3],
                           "embedder_tokens": [1, 2, 3]}
    folders = {tuple(key.split("/")[1:3]) for key in _keys(s3, "switching") if key.count("/") >= 3}
    assert folders == {(m, v) for m in STEPS for v in ("3", "4")} | {("embedder", "4"), ("embedder_tokens", "4")}
    assert "deleted (served by no config)" in "\n".join(done.describe())


def test_files_beside_the_configs_that_a_stopped_publish_left_old_are_uploaded_by_the_next(s3, exports):
    destination = _destination(s3, "sides")
    pub.publish(exports["a"]["repo"], destination)

    def stop_after_the_switch(key: str) -> None:  # the last ensemble's config; the files beside the configs go after
        if key == "sides/embedder_tokens/config.pbtxt":
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        pub.publish(exports["b"]["repo"], destination, after_upload=stop_after_the_switch)
    assert [s.model_version for s in _config(s3, "sides", "embedder").ensemble_scheduling.step] == [2, 2]
    fresh = (exports["b"]["repo"] / "embedder_encoder" / "validation.json").read_bytes()
    assert _extras(s3, "sides") != fresh  # the version served is b's, the report beside it a's
    plan = pub.plan_publish(exports["b"]["repo"], destination)
    assert plan.groups == [] and "sides/embedder_encoder/validation.json" in [key for _, key, _ in plan.refreshed]
    assert "  ~ sides/embedder_encoder/validation.json (differs from the store's)" in plan.describe()
    pub.publish(exports["b"]["repo"], destination)
    assert _extras(s3, "sides") == fresh
    assert pub.plan_publish(exports["b"]["repo"], destination).refreshed == []


def test_a_check_that_fails_in_one_group_switches_no_group(s3, exports, tiny_tokenizer, tmp_path):
    from helpers.tiny_models import build_tiny

    repos = {}
    for label, seed in (("a", 2), ("b", 3)):  # the embedder of each export, and a second model beside it
        repos[label] = tmp_path / f"two_{label}"
        shutil.copytree(exports[label]["repo"], repos[label])
        checkpoint = build_tiny("bert", tmp_path / f"second_{label}", tiny_tokenizer, seed=seed)
        run_export(ExportOptions(model=str(checkpoint), name="second", out=repos[label]))
    destination = _destination(s3, "groups")
    assert [g.version for g in pub.publish(repos["a"], destination).groups] == [1, 1]
    before = {m: _config(s3, "groups", m) for m in ("embedder", "second")}
    client = s3.client()

    def tamper(key: str) -> None:  # the second group's graph, replaced between upload and check
        if key.endswith("second_encoder/2/model.onnx"):
            client.put_object(Bucket=BUCKET, Key=key, Body=b"not the model")

    with pytest.raises(pub.PublishError, match="nothing was switched, the previous versions still serve"):
        pub.publish(repos["b"], destination, after_upload=tamper)
    assert {m: _config(s3, "groups", m) for m in ("embedder", "second")} == before  # the first group too


def test_a_publish_stopped_by_sigterm_releases_its_lock(s3, exports):
    # a CI job's timeout or a deleted Kubernetes Job stops it with SIGTERM, here right after it uploaded a graph
    code = ("import os, signal, sys\n"
            "from nexus_sli.cli.main import main\n"
            "from nexus_sli.exporter.triton import publish\n"
            "put = publish.Store.put\n"
            "def put_then_terminated(self, key, *args, **kwargs):\n"
            "    put(self, key, *args, **kwargs)\n"
            "    if key.endswith('model.onnx'):\n"
            "        os.kill(os.getpid(), signal.SIGTERM)\n"
            "publish.Store.put = put_then_terminated\n"
            "sys.exit(main(sys.argv[1:]))\n")
    result = subprocess.run([sys.executable, "-c", code, "publish", "--repository", str(exports["a"]["repo"]), "--to",
                             f"s3://{BUCKET}/terminated", "--endpoint-url", s3.endpoint],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 130, result.stderr
    keys = _keys(s3, "terminated")
    assert any(key.endswith("model.onnx") for key in keys) and f"terminated/{pub.LOCK}" not in keys


def _folder_lines(out: str, before: str, after: str) -> dict[str, str]:
    """``{model: "1, 2"}`` from the lines ``MODEL{before}1, 2{after}`` of ``out``."""
    found = {}
    for line in out.splitlines():
        if before in line and line.endswith(after):
            model, rest = line.split(before, 1)
            found[model] = rest[:len(rest) - len(after)] if after else rest
    return found


def test_a_dry_run_with_prune_lists_exactly_the_folders_the_publish_deletes(s3, exports, capsys):
    destination = _destination(s3, "pruning")
    pub.publish(exports["a"]["repo"], destination)
    pub.publish(exports["b"]["repo"], destination)  # the steps serve 1 and 2, the ensembles 2
    args = ["publish", "--repository", str(exports["a"]["repo"]), "--to", f"s3://{BUCKET}/pruning",
            "--endpoint-url", s3.endpoint, "--prune"]
    keys = _keys(s3, "pruning")
    assert main([*args, "--dry-run"]) == 0
    dry = capsys.readouterr().out
    assert _keys(s3, "pruning") == keys
    assert main(args) == 0
    done = capsys.readouterr().out
    # the third publish switches the steps to 2 and 3, the ensembles to 3: version 1 of the steps, and 1 and 2 of the
    # ensembles, are served by no config after it, although before it only the ensembles' 1 was unserved
    would = _folder_lines(dry, ": would delete version folders ", " (served by no config after the switch)")
    deleted = _folder_lines(done, ": version folders ", " deleted (served by no config)")
    assert would == deleted == {"embedder_tokenizer": "1", "embedder_encoder": "1", "embedder": "1, 2",
                                "embedder_tokens": "1, 2"}, dry
    folders = {tuple(key.split("/")[1:3]) for key in _keys(s3, "pruning") if key.count("/") >= 3}
    assert folders == {(m, v) for m in STEPS for v in ("2", "3")} | {("embedder", "3"), ("embedder_tokens", "3")}


def test_files_an_older_export_left_beside_a_config_are_deleted_after_the_switch(s3, exports, capsys):
    destination = _destination(s3, "extras")
    pub.publish(exports["a"]["repo"], destination)
    client = s3.client()
    stale = "extras/embedder_encoder/revalidation.json"  # another model's, published there before
    elsewhere = "extras/another_model/revalidation.json"  # beside a model this repository does not publish
    for key in (stale, elsewhere):
        client.put_object(Bucket=BUCKET, Key=key, Body=b'{"model": "another"}')
    args = ["publish", "--to", f"s3://{BUCKET}/extras", "--endpoint-url", s3.endpoint, "--repository"]
    assert main([*args, str(exports["a"]["repo"]), "--dry-run"]) == 0
    assert f"  - {stale} (would delete: not in the repository)" in capsys.readouterr().out
    assert stale in _keys(s3, "extras")

    at_switch = []

    def at_the_switch(key: str) -> None:  # the live export's files stay until the ensemble has switched
        if key == "extras/embedder/config.pbtxt":
            at_switch.append(stale in _keys(s3, "extras"))

    pub.publish(exports["b"]["repo"], destination, after_upload=at_the_switch)
    assert at_switch == [True]  # the switch happened, and the stale file was still there
    keys = _keys(s3, "extras")
    assert stale not in keys and elsewhere in keys
    assert {"extras/embedder_encoder/validation.json", "extras/embedder_encoder/reference.npz"} <= keys
    assert {tuple(key.split("/")[1:3]) for key in keys if key.count("/") >= 3} >= {(m, "1") for m in STEPS}
    # an unchanged repository too: nothing to upload, the stale file still goes
    client.put_object(Bucket=BUCKET, Key=stale, Body=b'{"model": "another"}')
    assert main([*args, str(exports["b"]["repo"])]) == 0
    out = capsys.readouterr().out
    assert f"  - {stale} (deleted: not in the repository)" in out and "new version" not in out
    assert stale not in _keys(s3, "extras")


def test_a_step_whose_config_changed_is_refused_not_applied_to_the_previous_version(s3, exports, tmp_path):
    destination = _destination(s3, "reconfigured")
    pub.publish(exports["a"]["repo"], destination)
    before, keys = _configs_bytes(s3, "reconfigured"), _keys(s3, "reconfigured")
    changed = tmp_path / "repo"
    shutil.copytree(exports["b"]["repo"], changed)
    path = changed / "embedder_encoder" / "config.pbtxt"
    config = text_format.Parse(path.read_text(), pb.ModelConfig())
    config.max_batch_size += 1  # what another export of other limits would change
    path.write_text(text_format.MessageToString(config))
    for run in (pub.plan_publish, pub.publish):  # --dry-run says so too
        with pytest.raises(pub.PublishError, match="embedder_encoder's config differs.*new prefix"):
            run(changed, destination)
    assert _configs_bytes(s3, "reconfigured") == before and _keys(s3, "reconfigured") == keys
    pub.publish(changed, _destination(s3, "reconfigured-2"))  # a new prefix takes it


def test_the_store_refuses_an_object_whose_checksum_differs(s3):
    store = pub.Store(_destination(s3, "checksums"))
    with pytest.raises(pub.PublishError, match="BadDigest"):
        store.put("checksums/x", b"what was sent", pub.sha256_b64(b"what the sender hashed"))
    assert _keys(s3, "checksums") == set()


def test_one_publisher_at_a_time(s3, exports):
    destination = _destination(s3, "concurrent")
    client = s3.client()
    # a lock left by another publish: nothing is written
    client.put_object(Bucket=BUCKET, Key=f"concurrent/{pub.LOCK}", Body=b"another publish")
    with pytest.raises(pub.ConcurrentPublishError, match="another publish"):
        pub.publish(exports["a"]["repo"], destination)
    assert _keys(s3, "concurrent") == {f"concurrent/{pub.LOCK}"}
    client.delete_object(Bucket=BUCKET, Key=f"concurrent/{pub.LOCK}")
    # a publisher that took the same version number (one that ignores the lock) is not overwritten
    plan = pub.plan_publish(exports["a"]["repo"], destination)
    theirs = plan.groups[0].uploads[1][1]

    def other_writer(key: str) -> None:
        if key == plan.groups[0].uploads[0][1]:
            client.put_object(Bucket=BUCKET, Key=theirs, Body=b"the other publish's file")

    with pytest.raises(pub.ConcurrentPublishError, match="already exists"):
        pub.publish(exports["a"]["repo"], destination, after_upload=other_writer)
    assert client.get_object(Bucket=BUCKET, Key=theirs)["Body"].read() == b"the other publish's file"
    assert not any(key.endswith("config.pbtxt") for key in _keys(s3, "concurrent"))
    assert f"concurrent/{pub.LOCK}" not in _keys(s3, "concurrent")  # released after the error


def test_credentials_are_never_printed(s3, exports, capsys, monkeypatch):
    args = ["publish", "--repository", str(exports["a"]["repo"]), "--to", f"s3://{BUCKET}/creds",
            "--endpoint-url", s3.endpoint]
    assert main(args) == 0
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "a-wrong-secret-value")
    assert main(args) == 2
    out, err = capsys.readouterr()
    assert "SignatureDoesNotMatch" in err or "AccessDenied" in err
    for secret in (object_store.SECRET_KEY, "a-wrong-secret-value"):
        assert secret not in out and secret not in err


def test_a_prefix_with_nothing_published_stops_the_server(s3, tmp_path):
    # no local check applies to a URL: Triton's own ("repository path is not a valid directory") ends it
    with open(tmp_path / "server.log", "wb") as log, pytest.raises(serve.ServerError, match="exited with code"):
        serve.start(s3.triton_url(BUCKET, "nothing/published"), *object_store.free_ports(3), stdout=log, stderr=log)
    assert b"repository path is not a valid directory" in (tmp_path / "server.log").read_bytes()


def test_gpu_on_cpu_cannot_apply_to_an_object_store(s3):
    with pytest.raises(serve.ServerError, match="local shadow"):
        serve.start(s3.triton_url(BUCKET, "prod"), *object_store.free_ports(3), gpu_on_cpu=True)


def test_the_serve_command_passes_an_s3_url_intact(monkeypatch):
    # Path("s3://host:port/b") would fold the '//': the command must hand Triton the URL as given
    seen = []
    monkeypatch.setattr(serve, "serve_forever", lambda repository, *args, **kwargs: seen.append(repository) or 0)
    ports = [str(p) for p in object_store.free_ports(3)]
    assert main(["serve", "--model-repository", "s3://127.0.0.1:9000/models/prod", "--http-port", ports[0],
                 "--grpc-port", ports[1], "--metrics-port", ports[2], "--gateway-port", "0"]) == 0
    assert seen == ["s3://127.0.0.1:9000/models/prod"]
    assert serve.server_args(seen[0], 1, 2, 3)[0] == "--model-repository=s3://127.0.0.1:9000/models/prod"


def test_the_kubernetes_command_line_serves_from_object_storage(s3, exports, tmp_path):
    """The rendered Deployment's tritonserver arguments, run here as the kubelet would (its
    $(VAR)s substituted), on Triton 2.51: they serve the published repository, refuse the
    restricted APIs without the Secret's header, and export the autoscaler's two counters."""
    import re
    import secrets
    import shutil
    import subprocess
    import urllib.error
    import urllib.request

    from helpers.k8s import render

    pub.publish(exports["a"]["repo"], _destination(s3, "k8s"))
    (deployment,) = [d for d in render("cpu") if d["kind"] == "Deployment" and d["metadata"]["name"] == "nexus-sli-triton"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    http, grpc, metrics = object_store.free_ports(3)
    key = secrets.token_urlsafe(24)
    values = {"MODEL_REPOSITORY": s3.triton_url(BUCKET, "k8s"), "NEXUS_SLI_ADMIN_KEY": key}
    # the pod's fixed ports and wildcard address become free loopback ones here: nothing else changes
    local = {"--http-port=8000": f"--http-port={http}", "--grpc-port=8001": f"--grpc-port={grpc}",
             "--metrics-port=8002": f"--metrics-port={metrics}"}
    assert container["args"][0] == "tritonserver"  # run by the image's entrypoint in the pod
    args = [local.get(a, a.replace("=0.0.0.0", "=127.0.0.1")) for a in container["args"][1:]]
    args = [re.sub(r"\$\((\w+)\)", lambda m: values[m.group(1)], a) for a in args]
    # the same binary and backends `nexus-sli serve` uses here (the pod's image has its own)
    base = serve.server_command(values["MODEL_REPOSITORY"], http, grpc, metrics)
    argv = [base.argv[0], *args, *([f"--backend-directory={base.backend_dir}"] if base.backend_dir else [])]
    with open(tmp_path / "server.log", "wb") as log:
        process = subprocess.Popen(argv, env=base.env, stdout=log, stderr=log)
    try:
        serve.wait_ready(http, process)
        assert np.allclose(_embed(f"127.0.0.1:{grpc}"), exports["a"]["reference"], atol=1e-4)
        index = f"http://127.0.0.1:{http}/v2/repository/index"
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(urllib.request.Request(index, data=b"{}", method="POST"), timeout=10)
        assert refused.value.code == 403
        allowed = urllib.request.Request(index, data=b"{}", method="POST", headers={serve.ADMIN_HEADER: key})
        with urllib.request.urlopen(allowed, timeout=10) as response:
            assert response.status == 200
        # model control is off: even with the header, models cannot be loaded or unloaded
        unload = urllib.request.Request(f"http://127.0.0.1:{http}/v2/repository/models/embedder/unload",
                                        data=b"{}", method="POST", headers={serve.ADMIN_HEADER: key})
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(unload, timeout=10)
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=10) as response:
            scraped = response.read().decode()
        for counter in ("nv_inference_queue_duration_us", "nv_inference_request_success"):
            assert re.search(rf'^{counter}{{model="embedder_encoder",version="1"}} \d+', scraped, re.MULTILINE)
    finally:
        process.terminate()
        process.wait(30)
        if base.temporary_backend_dir:
            shutil.rmtree(base.backend_dir, ignore_errors=True)


def _lose_first_response(store: pub.Store, key: str) -> list:
    """The first PUT of ``key`` reaches the store, but its response is lost (a read timeout), so boto3's
    retry sends it again: what a flaky network does.  Returns the responses that were lost."""
    from botocore.exceptions import ReadTimeoutError

    lost = []

    def send_then_time_out(request, **_):
        if request.url.endswith("/" + key) and not lost:
            lost.append(store.client._endpoint.http_session.send(request))
            raise ReadTimeoutError(endpoint_url=request.url)

    store.client.meta.events.register("before-send.s3.PutObject", send_then_time_out)
    return lost


@pytest.mark.parametrize("lost", ["the lock", "a version folder's file"])
def test_a_retried_put_whose_first_response_was_lost_does_not_stop_the_publish(s3, exports, lost):
    # the retry's If-None-Match finds the first attempt's object: that is this publish's own, not another's
    prefix = f"retried-{'lock' if lost == 'the lock' else 'file'}"
    destination = _destination(s3, prefix)
    store = pub.Store(destination)
    key = destination.key(pub.LOCK) if lost == "the lock" else pub.plan_publish(
        exports["a"]["repo"], destination, store).groups[0].uploads[0][1]
    responses = _lose_first_response(store, key)
    plan = pub.publish(exports["a"]["repo"], destination, store)
    assert [r.status_code for r in responses] == [200]  # the first attempt did write
    assert [g.version for g in plan.groups] == [1] and plan.published
    assert f"{prefix}/{pub.LOCK}" not in _keys(s3, prefix)  # released, not left to block the next publish
    assert pub.plan_publish(exports["a"]["repo"], destination).groups == []  # everything verified up there


def test_a_publish_that_cannot_release_its_lock_reports_its_own_error(s3, exports, monkeypatch, caplog):
    destination = _destination(s3, "unreleased")
    store = pub.Store(destination)
    lock = destination.key(pub.LOCK)

    def store_gone(key: str) -> None:
        raise pub.PublishError("deleting: Could not connect to the endpoint URL (injected)")

    def fail(key: str) -> None:
        monkeypatch.setattr(store, "delete", store_gone)
        raise ConnectionError("network gone (injected)")

    with pytest.raises(ConnectionError, match="network gone"):
        pub.publish(exports["a"]["repo"], destination, store, after_upload=fail)
    assert f"delete s3://{BUCKET}/{lock} once no publish runs" in caplog.text


def _copy_as_kserve_does(s3, prefix: str, folder) -> None:
    """The published prefix copied to ``folder`` as KServe's storage initializer copies a storageUri
    (kserve_storage.Storage._download_s3): objects whose key ends in '/' or that are empty are skipped,
    and a folder exists only as the parent of a file copied into it."""
    pages = s3.client().get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    for item in (item for page in pages for item in page.get("Contents", [])):
        if item["Key"].endswith("/") or item["Size"] == 0:
            continue
        target = folder / item["Key"][len(prefix):].lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        s3.client().download_file(BUCKET, item["Key"], str(target))


def test_a_published_repository_copied_as_kserve_does_serves(s3, exports, tmp_path):
    # an ensemble's version folder holds no file: on the store it must still hold one that such a copy keeps,
    # or Triton finds no version of the ensemble to load
    pub.publish(exports["a"]["repo"], _destination(s3, "kserve"))
    copied = tmp_path / "mnt-models"
    _copy_as_kserve_does(s3, "kserve", copied)
    for model in MODELS:
        assert (copied / model / "1").is_dir(), model
    http, grpc, metrics = object_store.free_ports(3)
    with open(tmp_path / "server.log", "wb") as log:  # the folder as it is, as KServe's Triton runtime loads it
        process = serve.start(copied, http, grpc, metrics, separate_steps=True, stdout=log, stderr=log)
    try:
        assert np.allclose(_embed(f"127.0.0.1:{grpc}"), exports["a"]["reference"], atol=1e-4)
    finally:
        end_now(process)
