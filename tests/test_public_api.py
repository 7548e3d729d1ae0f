"""The encoder-support spec's names import from the package root, and are the step modules' own objects."""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "onnx", "onnxruntime")


def test_spec_names_import_from_the_exporter_package():
    from nexus_sli.exporter import (ArchitectureRegistry, BERTFamilyHandler, LayerCache, NexusError,
                                    get_int8_config, get_registry)
    from nexus_sli.exporter import errors
    from nexus_sli.exporter.export import handler, layer_cache, quantize

    assert BERTFamilyHandler is handler.BERTFamilyHandler and get_registry is handler.get_registry
    assert ArchitectureRegistry is handler.ArchitectureRegistry and NexusError is errors.NexusError
    assert LayerCache is layer_cache.LayerCache and get_int8_config is quantize.get_int8_config
    assert get_registry().families == [BERTFamilyHandler.family_id]


def test_the_package_lists_its_lazy_names_and_refuses_others():
    import nexus_sli.exporter as exporter

    assert {"BERTFamilyHandler", "LayerCache", "get_int8_config", "get_registry"} <= set(dir(exporter))
    with pytest.raises(AttributeError, match="no attribute 'Nonexistent'"):
        exporter.Nonexistent  # noqa: B018


def _heavy_modules_after(statement: str) -> list[str]:
    # a fresh interpreter: this one has long imported torch for other tests
    code = f"import sys; {statement}; print(' '.join(m for m in {HEAVY!r} if m in sys.modules))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()


def test_importing_the_exporter_package_stays_cheap():
    assert _heavy_modules_after("import nexus_sli.exporter") == []


def test_the_light_parts_import_without_torch():
    assert _heavy_modules_after("import nexus_sli.exporter, nexus_sli.exporter.errors, "
                                "nexus_sli.exporter.serving.server, nexus_sli.client, nexus_sli.cli.main") == []


def test_the_gateway_command_runs_where_only_its_extra_is_installed():
    """The gateway's image installs nexus-sli[gateway] alone: no onnx, torch or transformers.  Its command
    must still parse, and a command that needs what is missing says which extra to install."""
    import subprocess
    import sys

    blocked = "import sys\nfor m in ('onnx', 'onnxruntime', 'openvino', 'torch', 'transformers'): sys.modules[m] = None\n"
    script = blocked + ("from nexus_sli.cli.main import build_parser, main\n"
                        "args = build_parser().parse_args(['gateway', '--triton', 'dns:///triton-headless:8001'])\n"
                        "print(args.triton)\n"
                        "sys.exit(main(['export']))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "dns:///triton-headless:8001", done.stderr
    assert done.returncode == 2 and "'export' needs nexus-sli[export]" in done.stderr
    assert "pip install 'nexus-sli[export]'" in done.stderr
