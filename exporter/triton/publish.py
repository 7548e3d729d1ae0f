"""Publish a model repository to S3-compatible object storage, safely for running servers.

Triton reads ``<model>/config.pbtxt`` when it loads a model and picks version
folders by the config's ``version_policy``; servers on object storage copy the
model folder to local disk at load.  So a publish never changes a version
folder a server may be reading: every model of a changed ensemble gets a new
numbered version folder (one number for the whole group, never reused), and
only the small configs are replaced, each in one PUT (an object is replaced
whole on S3):

0. take the prefix's lock object (a conditional create: one publisher at a time);
1. upload the version folders (each object created only if absent, with its
   SHA-256, which the store may check), then download every object and compare
   its SHA-256 with the local file's;
2. the ensemble's steps' configs serve ``[previous, new]`` (previous: the
   version the ensemble pins now), then the ensemble's config pins its steps to
   the new version: that single PUT is the switch.  The steps keep serving the
   previous version too until the next publish replaces it: Triton reads the
   configs one model at a time, so a server starting during a publish may read
   the ensemble before the switch and a step after it, and must find the
   version the ensemble pins either way;
   (step 1 for every group before step 2 for any, so a failed check switches nothing);
3. the files beside config.pbtxt (validation data, not read by Triton); those the
   store holds beside a published model's config and the repository does not
   (an older export's) are deleted; with ``prune``, so are the version folders
   no config serves any more (:attr:`PublishPlan.unserved`, which a dry run
   lists); then the lock is released.

A step's config is shared by every version it serves, so a step whose config
changed cannot keep serving the previous version: that publish is refused
(publish to a new prefix).  A publish that fails or is killed in 1 leaves a
version folder no config names (the next publish takes the number after it);
in 2 the previous versions still serve.  Credentials come from boto3's standard
chain (environment, ``~/.aws``) and are never printed.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import os
import platform
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as pb

from nexus_sli.exporter.errors import NexusError

from .config import read as read_config

log = logging.getLogger(__name__)

CONFIG = "config.pbtxt"


class PublishError(NexusError):
    """The repository could not be published, or what was uploaded does not match what was sent."""


@dataclass(frozen=True)
class Destination:
    """``s3://bucket/prefix``; Triton's own form ``s3://HOST:PORT/bucket/prefix`` also names the endpoint."""

    bucket: str
    prefix: str
    endpoint_url: str | None = None

    @classmethod
    def parse(cls, url: str, endpoint_url: str | None = None) -> "Destination":
        if not url.startswith("s3://"):
            raise PublishError(f"--to must be an s3:// URL (s3://bucket/prefix), got {url!r}")
        rest = url[len("s3://"):]
        scheme, named_scheme = "http", False
        for given in ("https://", "http://"):
            if rest.startswith(given):
                scheme, rest, named_scheme = given[:-3], rest[len(given):], True
        parts = [p for p in rest.split("/") if p]
        if named_scheme and not (parts and ":" in parts[0]):  # else the host would be read as the bucket
            raise PublishError(f"{url!r} names a {scheme} store without its port: Triton's form is "
                               f"s3://{scheme}://HOST:PORT/bucket/prefix (or give --endpoint-url {scheme}://HOST)")
        if parts and ":" in parts[0]:  # s3://HOST:PORT/bucket/prefix, as Triton names a non-AWS store
            named = f"{scheme}://{parts.pop(0)}"
            if endpoint_url and endpoint_url.rstrip("/") != named:  # which store is meant is not ours to guess
                raise PublishError(f"--to names the store {named} and --endpoint-url {endpoint_url}: "
                                   "give one of them, or the same store in both")
            endpoint_url = named
        if not parts:
            raise PublishError(f"{url!r} names no bucket (s3://bucket/prefix)")
        return cls(parts[0], "/".join(parts[1:]), endpoint_url)

    def key(self, *parts: str) -> str:
        return "/".join(p.strip("/") for p in (self.prefix, *parts) if p)

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}".rstrip("/")


@dataclass
class LocalModel:
    name: str
    folder: Path
    config: pb.ModelConfig
    #: the highest numbered version folder (an export writes ``1``)
    version_dir: Path
    #: path relative to the version folder -> base64 SHA-256 (S3's ChecksumSHA256 form)
    files: dict[str, str]
    #: files beside config.pbtxt (the export's validation data; Triton does not read them)
    extras: dict[str, str]


#: Beside the models, under the prefix: present while a publish runs (created only if absent).
LOCK = ".nexus-sli-publish.lock"

#: A file in each published version folder that would otherwise be empty (an ensemble's): Triton
#: loads a version only from a folder that exists, and copiers that recreate folders only from the
#: files in them (KServe's storage initializer skips folder markers and empty objects) would drop it.
KEEP = ".nexus-sli-keep"
KEEP_BODY = b"Triton loads a model version only from a folder that exists; this file keeps this one.\n"


@dataclass
class RemoteModel:
    versions: set[int] = field(default_factory=set)
    config: pb.ModelConfig | None = None
    #: the files beside config.pbtxt on the store (names)
    extras: set[str] = field(default_factory=set)

    @property
    def served(self) -> list[int]:
        """The versions the config serves: its ``specific`` list, else the latest folder."""
        if self.config is not None and self.config.version_policy.HasField("specific"):
            return sorted(self.config.version_policy.specific.versions)
        return [max(self.versions)] if self.versions else []


@dataclass
class PublishGroup:
    """One ensemble and its steps (or the ensembles that share steps, or a model alone), published
    together under one version number."""

    #: the steps first, the ensembles last
    models: list[str]
    ensembles: list[str]
    version: int
    previous: dict[str, list[int]]
    reason: str
    uploads: list[tuple[Path | bytes, str, str]]  # (local file or the bytes, key, sha256): the new version folders
    #: the versions each model's config serves after the switch (a step: previous and new)
    serves: dict[str, list[int]] = field(default_factory=dict)
    #: files beside config.pbtxt, uploaded after the switch (Triton does not read them)
    extras: list[tuple[Path, str, str]] = field(default_factory=list)


@dataclass
class PublishPlan:
    """What publishing a repository uploads and switches (:func:`plan_publish`; :func:`publish` returns what it did)."""

    destination: Destination
    groups: list[PublishGroup]
    #: models whose published version equals the export, and the versions they serve
    unchanged: dict[str, list[int]]
    #: version folders on the store that no config serves (left by an interrupted publish, or older)
    unreferenced: dict[str, list[int]]
    local: dict[str, LocalModel] = field(repr=False, default_factory=dict)
    #: version folders no config serves once this publish has switched: what ``prune`` deletes
    unserved: dict[str, list[int]] = field(default_factory=dict)
    #: keys of files beside a published model's config.pbtxt that the repository lacks: deleted after the switch
    stale: list[str] = field(default_factory=list)
    #: files beside an unchanged model's config.pbtxt that differ from the store's (an earlier publish stopped
    #: before it uploaded them, or only they changed): uploaded after the switch
    refreshed: list[tuple[Path, str, str]] = field(default_factory=list)
    #: whether the publish deletes :attr:`unserved` (``--prune``)
    prune: bool = False
    #: version folders deleted after the switch (``--prune``): none a config serves
    pruned: dict[str, list[int]] = field(default_factory=dict)
    #: whether this is what a publish did (else what it would do: a dry run)
    published: bool = False

    def describe(self) -> list[str]:
        lines = []
        for group in self.groups:
            lines.append(f"{', '.join(group.models)}: new version {group.version} ({group.reason}); "
                         f"{len(group.uploads)} files")
            lines += [f"  + {key}" for _, key, _ in group.uploads]
            for model in group.models:
                serves = group.serves.get(model, [group.version])
                lines.append(f"  ~ {self.destination.key(model, CONFIG)}: serves version "
                             f"{', '.join(map(str, serves))}"
                             + (f" (was {group.previous[model]})" if group.previous.get(model) else ""))
            lines += [f"  ~ {key} (after the switch)" for _, key, _ in group.extras]
        lines += [f"{name}: unchanged (serving version {', '.join(map(str, v))})" for name, v in self.unchanged.items()]
        lines += [f"  ~ {key} (differs from the store's)" for _, key, _ in self.refreshed]
        lines += [f"  - {key} ({'deleted' if self.published else 'would delete'}: not in the repository)"
                  for key in self.stale]
        for name, versions in sorted(self.unserved.items()):
            folders = ", ".join(map(str, versions))
            if not self.prune:
                lines.append(f"{name}: version folders {folders} are on the store but not served (kept; --prune "
                             "deletes them)")
            elif self.published:
                lines.append(f"{name}: version folders {folders} deleted (served by no config)")
            else:
                lines.append(f"{name}: would delete version folders {folders} (served by no config after the switch)")
        return lines or ["nothing to publish"]


def sha256_b64(data: bytes) -> str:
    return base64.b64encode(hashlib.sha256(data).digest()).decode()


def _file_sha(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return base64.b64encode(digest.digest()).decode()


#: S3's limit for one PUT; larger files would need a multipart upload, which this does not do.
MAX_OBJECT_BYTES = 5 * 1024 ** 3


def read_local(repository: Path) -> dict[str, LocalModel]:
    """Every model folder (one with a config.pbtxt) of an exported repository; its highest version folder."""
    repository = Path(repository)
    models = {}
    for config_path in sorted(repository.glob(f"*/{CONFIG}")):
        folder = config_path.parent
        versions = sorted((int(p.name), p) for p in folder.iterdir() if p.is_dir() and p.name.isdigit())
        if not versions:
            raise PublishError(f"{folder} has no numbered version folder: not a model Triton can load")
        version_dir = versions[-1][1]
        too_large = [p for p in version_dir.rglob("*") if p.is_file() and p.stat().st_size > MAX_OBJECT_BYTES]
        if too_large:
            raise PublishError(f"{too_large[0]} is larger than one S3 PUT (5 GiB); multipart upload is not supported")
        files = {p.relative_to(version_dir).as_posix(): _file_sha(p)
                 for p in sorted(version_dir.rglob("*")) if p.is_file() and "__pycache__" not in p.parts}
        extras = {p.name: _file_sha(p) for p in sorted(folder.iterdir()) if p.is_file() and p.name != CONFIG}
        models[folder.name] = LocalModel(folder.name, folder, read_config(config_path), version_dir, files, extras)
    if not models:
        raise PublishError(f"{repository} holds no model (run 'make export' first)")
    return models


def groups_of(models: dict[str, LocalModel]) -> list[list[str]]:
    """Ensembles with the steps they use (steps first, the ensembles last); ensembles that share a step
    (an embedding's ``NAME`` and ``NAME_tokens`` share its tokenizer and encoder) in one group, as a step
    gets one version number; other models alone."""
    groups: list[tuple[list[str], list[str]]] = []  # (steps, ensembles)
    for name, model in sorted(models.items()):
        if model.config.platform != "ensemble":
            continue
        steps = list(dict.fromkeys(s.model_name for s in model.config.ensemble_scheduling.step))
        missing = [s for s in steps if s not in models]
        if missing:
            raise PublishError(f"ensemble {name} uses {', '.join(missing)}, which {model.folder.parent} lacks")
        sharing = [g for g in groups if set(g[0]) & set(steps)]
        merged = ([*dict.fromkeys([*(s for g in sharing for s in g[0]), *steps])],
                  [*(e for g in sharing for e in g[1]), name])
        at = groups.index(sharing[0]) if sharing else len(groups)
        groups = [g for g in groups if g not in sharing]
        groups.insert(min(at, len(groups)), merged)
    grouped = [[*steps, *ensembles] for steps, ensembles in groups]
    taken = {name for group in grouped for name in group}
    return grouped + [[name] for name in sorted(models) if name not in taken]


def _normalized(config: pb.ModelConfig) -> str:
    """The config without what publishing sets (versions served, the ensemble's pinned step versions)."""
    copy = pb.ModelConfig()
    copy.CopyFrom(config)
    copy.ClearField("version_policy")
    for step in copy.ensemble_scheduling.step:
        step.model_version = -1
    return text_format.MessageToString(copy)


def published_config(config: pb.ModelConfig, versions: list[int], pin: int | None = None) -> bytes:
    """``config`` serving exactly ``versions``; an ensemble's steps pinned to version ``pin``."""
    copy = pb.ModelConfig()
    copy.CopyFrom(config)
    copy.version_policy.specific.versions[:] = versions
    if pin is not None:
        for step in copy.ensemble_scheduling.step:
            step.model_version = pin
    return text_format.MessageToString(copy).encode()


class Store:
    """The few S3 calls publishing needs (boto3; credentials from its standard chain)."""

    def __init__(self, destination: Destination):
        try:
            import boto3
            from botocore.config import Config
        except ImportError as exc:
            raise PublishError("publishing needs boto3: pip install 'nexus-sli[publish]'") from exc
        self.destination = destination
        self.bucket = destination.bucket
        # retries in boto3's standard mode; checksums only when asked (S3-compatible stores vary)
        # a session of its own: boto3's default one keeps the credentials it first found
        self.client = boto3.session.Session().client("s3", endpoint_url=destination.endpoint_url,
                                                     config=Config(retries={"mode": "standard", "max_attempts": 5},
                                                                   request_checksum_calculation="when_required",
                                                                   response_checksum_validation="when_required"))

    def _call(self, what: str, fn, **kwargs):
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return fn(Bucket=self.bucket, **kwargs)
        except (ClientError, BotoCoreError) as exc:
            raise self._failed(what, exc) from None

    def _failed(self, what: str, exc: Exception) -> PublishError:
        """The store's error code and message: never the credentials."""
        from botocore.exceptions import ClientError

        if isinstance(exc, ClientError):
            error = exc.response.get("Error", {})
            return PublishError(f"{what} on s3://{self.bucket} failed: {error.get('Code', '?')}: "
                                f"{error.get('Message', '')}")
        return PublishError(f"{what} on s3://{self.bucket} failed: {exc}")

    def keys(self, prefix: str) -> list[str]:
        found, token = [], None
        while True:
            page = self._call("listing", self.client.list_objects_v2, Prefix=prefix,
                              **({"ContinuationToken": token} if token else {}))
            found += [item["Key"] for item in page.get("Contents", [])]
            if not page.get("IsTruncated"):
                return found
            token = page["NextContinuationToken"]

    def get(self, key: str) -> bytes:
        return self._call(f"reading {key}", self.client.get_object, Key=key)["Body"].read()

    def put(self, key: str, body: bytes, sha: str, create: bool = False) -> None:
        """One object.  ``sha`` goes with it as ``x-amz-checksum-sha256`` (a store that checks it, as AWS
        and SeaweedFS do, refuses a mismatch; ``verify`` does not rely on it).  ``create``: only if no
        object has that key (``If-None-Match: *``), else :class:`ConcurrentPublishError`, unless the
        object there holds exactly ``body``: this PUT's own earlier attempt, which reached the store
        although its response was lost, and which boto3 then retried."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self.client.put_object(Bucket=self.bucket, Key=key, Body=body, ChecksumSHA256=sha,
                                   **({"IfNoneMatch": "*"} if create else {}))
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "")
            if create and code in ("PreconditionFailed", "412", "ConditionalRequestConflict"):
                if self._holds(key, sha):
                    return
                raise ConcurrentPublishError(f"s3://{self.bucket}/{key} already exists: another publish is "
                                             "writing to this prefix (or was killed while it did)") from None
            raise self._failed(f"uploading {key}", exc) from None
        except BotoCoreError as exc:
            raise self._failed(f"uploading {key}", exc) from None

    def _holds(self, key: str, sha: str) -> bool:
        """Whether the object at ``key`` has the SHA-256 ``sha`` (False where it cannot be read: gone since)."""
        try:
            return self.verify(key) == sha
        except PublishError:
            return False

    def verify(self, key: str) -> str:
        """The SHA-256 of the object's bytes as downloaded now: what a server will read, whatever
        checksum header the store keeps."""
        digest = hashlib.sha256()
        body = self._call(f"reading {key}", self.client.get_object, Key=key)["Body"]
        for block in iter(lambda: body.read(1 << 20), b""):
            digest.update(block)
        return base64.b64encode(digest.digest()).decode()

    def checksum(self, key: str) -> str:
        """The object's SHA-256 as the store recorded it (its ``ChecksumSHA256``, which a publish
        verified by download when it wrote it); downloaded and hashed where the store keeps none.
        For telling whether a published file differs from a local one."""
        head = self._call(f"checking {key}", self.client.head_object, Key=key, ChecksumMode="ENABLED")
        stored = head.get("ChecksumSHA256")
        if stored and "-" not in stored:  # a multipart upload's checksum is of its parts
            return stored
        return self.verify(key)

    def delete(self, key: str) -> None:
        self._call(f"deleting {key}", self.client.delete_object, Key=key)


class ConcurrentPublishError(PublishError):
    """Another publish holds the prefix's lock or wrote the same version folder."""


def read_remote(store: Store, names: list[str]) -> dict[str, RemoteModel]:
    remote = {name: RemoteModel() for name in names}
    base = store.destination.key()
    for key in store.keys(base + "/" if base else ""):
        parts = key[len(base):].strip("/").split("/") if base else key.split("/")
        if len(parts) >= 2 and parts[0] in remote and parts[1].isdigit():
            remote[parts[0]].versions.add(int(parts[1]))
        elif parts[-1] == CONFIG and len(parts) == 2 and parts[0] in remote:
            remote[parts[0]].config = text_format.Parse(store.get(key).decode(), pb.ModelConfig())
        elif len(parts) == 2 and parts[0] in remote and parts[1]:
            remote[parts[0]].extras.add(parts[1])
    return remote


def _changed(store: Store, local: LocalModel, remote: RemoteModel) -> str | None:
    """Why ``local`` differs from what the store serves now, or None when it does not."""
    if remote.config is None or not remote.served:
        return "not published yet"
    if _normalized(remote.config) != _normalized(local.config):
        return "config changed"
    version = remote.served[-1]
    prefix = store.destination.key(local.name, str(version)) + "/"
    stored = {k[len(prefix):] for k in store.keys(prefix) if not k.endswith("/")} - {KEEP}
    if stored != set(local.files):
        return f"files differ from version {version}"
    for name, sha in local.files.items():
        if store.checksum(prefix + name) != sha:
            return f"{name} differs from version {version}"
    return None


def plan_publish(repository: Path, destination: Destination, store: Store | None = None,
                 prune: bool = False) -> PublishPlan:
    """What publishing ``repository`` to ``destination`` would upload, switch and delete (nothing is written);
    ``prune``: as :func:`publish` takes it."""
    store = store or Store(destination)
    local = read_local(repository)
    remote = read_remote(store, list(local))
    groups, unchanged, refreshed = [], {}, []
    for names in groups_of(local):
        reasons = {n: _changed(store, local[n], remote[n]) for n in names}
        changed = [f"{n}: {r}" for n, r in reasons.items() if r]
        if not changed and not _switched([n for n in names if local[n].config.platform == "ensemble"], remote):
            changed = ["an earlier publish stopped while switching the configs"]
        if not changed:
            unchanged.update({n: remote[n].served for n in names})
            refreshed += [(local[n].folder / rel, destination.key(n, rel), sha) for n in names
                          for rel, sha in local[n].extras.items()
                          if rel not in remote[n].extras or store.checksum(destination.key(n, rel)) != sha]
            continue
        # one number for the group, above every folder on the store, partial ones included
        version = 1 + max((v for n in names for v in remote[n].versions), default=0)
        ensembles = [n for n in names if local[n].config.platform == "ensemble"]
        keep = _pinned(ensembles, remote)
        for name, kept in keep.items():
            if kept and _normalized(remote[name].config) != _normalized(local[name].config):
                raise PublishError(
                    f"{name}'s config differs from the one published at {destination}: Triton applies a "
                    f"model's one config to every version it serves, and {name} must keep serving version "
                    f"{kept[0]} while servers switch, under the new config it may fail to load or answer "
                    "wrongly.  Publish this export to a new prefix and point the servers at it")
        uploads, extras = [], []
        for name in names:
            model = local[name]
            uploads += [(model.version_dir / rel, destination.key(name, str(version), rel), sha)
                        for rel, sha in model.files.items()]
            # an ensemble's empty version folder: S3 has no folders, so a marker object and a file (KEEP)
            if not model.files:
                folder = destination.key(name, str(version))
                uploads += [(b"", folder + "/", sha256_b64(b"")),
                            (KEEP_BODY, f"{folder}/{KEEP}", sha256_b64(KEEP_BODY))]
            extras += [(model.folder / rel, destination.key(name, rel), sha) for rel, sha in model.extras.items()]
        serves = {n: sorted(set(keep.get(n, [])) | {version}) for n in names}
        groups.append(PublishGroup(names, ensembles, version, {n: remote[n].served for n in names},
                                "; ".join(changed), uploads, serves, extras))
    unreferenced = {n: sorted(r.versions - set(r.served)) for n, r in remote.items() if r.versions - set(r.served)}
    stale = [destination.key(n, f) for n in local for f in sorted(remote[n].extras - set(local[n].extras))]
    return PublishPlan(destination, groups, unchanged, unreferenced, local, _unserved(remote, groups, unchanged),
                       stale, refreshed, prune)


def _unserved(remote: dict[str, RemoteModel], groups: list[PublishGroup],
              unchanged: dict[str, list[int]]) -> dict[str, list[int]]:
    """Per model, the version folders on the store that no config serves once the groups have switched."""
    serves = {**unchanged, **{name: group.serves[name] for group in groups for name in group.models}}
    left = {name: sorted(remote[name].versions - set(versions)) for name, versions in serves.items()}
    return {name: versions for name, versions in left.items() if versions}


def _published_ensembles(ensembles: list[str], remote: dict[str, RemoteModel]) -> list[pb.ModelConfig]:
    return [c for c in (remote[n].config for n in ensembles) if c is not None and c.platform == "ensemble"]


def _switched(ensembles: list[str], remote: dict[str, RemoteModel]) -> bool:
    """Whether each published ensemble pins its steps' newest served versions (not so after a publish
    stopped between the steps' configs and the ensembles')."""
    return all(remote[step.model_name].served and step.model_version == remote[step.model_name].served[-1]
               for config in _published_ensembles(ensembles, remote) for step in config.ensemble_scheduling.step)


def _pinned(ensembles: list[str], remote: dict[str, RemoteModel]) -> dict[str, list[int]]:
    """Per step, the versions the published ensembles pin now (what their steps must keep serving
    through the switch), where the step's folder for them is on the store."""
    pins: dict[str, set[int]] = {}
    for config in _published_ensembles(ensembles, remote):
        for step in config.ensemble_scheduling.step:
            found = remote.get(step.model_name)
            if found is not None and step.model_version in found.versions:
                pins.setdefault(step.model_name, set()).add(step.model_version)
    return {step: sorted(versions) for step, versions in pins.items()}


#: Called after each uploaded object (files, then configs) with its key (tests use it to stop a publish midway).
UploadHook = Callable[[str], None]


def publish(repository: Path, destination: Destination, store: Store | None = None,
            after_upload: UploadHook | None = None, prune: bool = False) -> PublishPlan:
    """Upload what changed as new version folders, verify every checksum, then switch the configs.

    One publisher at a time per prefix: the lock object ``<prefix>/.nexus-sli-publish.lock`` is
    created only if absent (:class:`ConcurrentPublishError` otherwise) and deleted at the end, also
    after an error; a publish killed outright leaves it, to be deleted by hand once no publish runs.

    After the switch, the files beside a model's config.pbtxt on the store that the repository lacks
    (:attr:`PublishPlan.stale`, an older export's) are deleted.

    ``prune``: after the switch, delete the version folders of the repository's models that no
    config serves any more (:attr:`PublishPlan.unserved`, as the plan, and so a dry run, lists them;
    servers copy a model's whole folder, every version in it, when they load it).  The versions the
    configs serve, the previous one included, stay."""
    store = store or Store(destination)
    lock = destination.key(LOCK)
    # unique to this publish: an existing lock with these bytes is its own (Store.put)
    body = (f"nexus-sli publish: host {platform.node()}, pid {os.getpid()}, since {time.time():.0f}, "
            f"token {secrets.token_hex(16)}\n").encode()
    try:
        store.put(lock, body, sha256_b64(body), create=True)
    except ConcurrentPublishError:
        raise ConcurrentPublishError(
            f"s3://{destination.bucket}/{lock} exists: another publish to {destination} is running. If none "
            "is (one was killed), delete that object and publish again") from None
    try:
        result = plan_publish(repository, destination, store, prune)
        for group in result.groups:  # every group's folders verified before any config changes
            _upload(store, group.uploads, after_upload, create=True)
            log.info("%s: version %d, %d files uploaded and verified", ", ".join(group.models), group.version,
                     len(group.uploads))
        for group in result.groups:
            _switch(store, group, result.local, after_upload)
        _upload(store, [*(f for group in result.groups for f in group.extras), *result.refreshed], after_upload,
                switched=bool(result.groups))
        for key in result.stale:
            store.delete(key)
            log.info("deleted %s (not in the repository)", key)
        if prune:
            result.pruned = _prune(store, result.unserved)
        result.published = True
    except BaseException:
        _release_after_error(store, lock)
        raise
    store.delete(lock)
    return result


def _release_after_error(store: Store, lock: str) -> None:
    """Delete the lock after a failed publish; if that fails too (the store unreachable, say), the
    publish's own error is the one to report, and the lock left behind is logged."""
    try:
        store.delete(lock)
    except PublishError as exc:
        log.error("%s; the lock stays: delete s3://%s/%s once no publish runs", exc, store.bucket, lock)


def _prune(store: Store, unserved: dict[str, list[int]]) -> dict[str, list[int]]:
    """Delete the version folders ``unserved`` names (the plan's: served by no config after the switch);
    what was deleted."""
    for name, versions in unserved.items():
        for version in versions:
            for key in store.keys(store.destination.key(name, str(version)) + "/"):
                store.delete(key)
        log.info("%s: deleted version folders %s (served by no config)", name, ", ".join(map(str, versions)))
    return dict(unserved)


def _upload(store: Store, uploads: list, after_upload: UploadHook | None, create: bool = False,
            switched: bool = False) -> None:
    """Upload, then verify each object; ``switched``: the files beside the configs, after every switch."""
    for path, key, sha in uploads:
        store.put(key, path if isinstance(path, bytes) else path.read_bytes(), sha, create=create)
        if after_upload is not None:
            after_upload(key)
    for _, key, sha in uploads:
        stored = store.verify(key)
        if stored != sha:
            where = ("the new versions serve, and the files beside their configs may be an older export's: publish "
                     "again" if switched else "nothing was switched, the previous versions still serve")
            raise PublishError(f"{key} on the store has SHA-256 {stored}, not {sha} as uploaded; {where}")


def _switch(store: Store, group: PublishGroup, local: dict[str, LocalModel], after_upload: UploadHook | None) -> None:
    """The configs, in the order that keeps every moment consistent for a server that starts then."""
    def put(name: str, versions: list[int], pin: int | None = None) -> None:
        body = published_config(local[name].config, versions, pin)
        _put_config(store, store.destination.key(name, CONFIG), body, after_upload)

    if not group.ensembles:
        put(group.models[0], [group.version])
        log.info("%s now serves version %d", group.models[0], group.version)
        return
    # an ensemble pins exact step versions; its steps serve the pinned one and the new one, before
    # and after its PUT (the next publish drops the older), so a server that reads the ensemble's
    # config and its steps' at any moments finds the versions the ensemble names
    for name in group.models:
        if name not in group.ensembles:
            put(name, group.serves[name])
    for name in group.ensembles:  # the switch: each ensemble's one PUT
        put(name, [group.version], group.version)
        log.info("%s now serves version %d", name, group.version)


def _put_config(store: Store, key: str, body: bytes, after_upload: UploadHook | None) -> None:
    sha = sha256_b64(body)
    store.put(key, body, sha)
    if store.verify(key) != sha:
        raise PublishError(f"{key} on the store does not match what was uploaded")
    if after_upload is not None:
        after_upload(key)
