"""The encoder-support spec's names import from the package root, and are the step modules' own objects."""

from __future__ import annotations


def test_spec_names_import_from_the_exporter_package():
    from nexus_sli.exporter import BERTFamilyHandler, LayerCache, get_int8_config, get_registry
    from nexus_sli.exporter.export import handler, layer_cache, quantize

    assert BERTFamilyHandler is handler.BERTFamilyHandler and get_registry is handler.get_registry
    assert LayerCache is layer_cache.LayerCache and get_int8_config is quantize.get_int8_config
    assert get_registry().families == [BERTFamilyHandler.family_id]


def test_the_light_parts_import_without_torch():
    import subprocess
    import sys

    code = ("import sys, nexus_sli.exporter, nexus_sli.exporter.errors, nexus_sli.exporter.serving.server, "
            "nexus_sli.client, nexus_sli.cli.main; print('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"
