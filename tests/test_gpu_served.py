"""The GPU check's served variants (bench/gpu_served.py): each is a copy of the GPU repository with its
settings written through Triton's config schema, the repository itself untouched; and its reading of where
ONNX Runtime places the graph's nodes.  The check serves the variants on a GPU host only (docs/gpu.md,
"Served on a GPU")."""

from __future__ import annotations

import re
from types import SimpleNamespace

from nexus_sli.bench.gpu_served import VARIANTS, ServedVariant, cpu_placed_nodes, variant_repository
from nexus_sli.exporter.triton import config as tc


def test_a_variant_writes_its_settings_into_a_copy_of_the_repository(tmp_path, exports):
    source = exports.copy("minilm_gpu", tmp_path / "source", as_name="minilm")
    variant = ServedVariant("x", instances=4, queue_delay_us=500, max_batch_size=64, tokenizer_instances=3)
    target = variant_repository(source, tmp_path / "variant", variant)
    encoder = tc.read(target / "minilm_encoder" / "config.pbtxt")
    assert encoder.instance_group[0].count == 4 and encoder.instance_group[0].kind == tc.pb.ModelInstanceGroup.KIND_GPU
    assert encoder.dynamic_batching.max_queue_delay_microseconds == 500
    assert tc.read(target / "minilm_tokenizer" / "config.pbtxt").instance_group[0].count == 3
    # every step that batches merges the variant's rows, so that the client's requests follow
    assert {tc.read(path).max_batch_size for path in target.glob("*/config.pbtxt")} == {64}
    exported = tc.read(source / "minilm_encoder" / "config.pbtxt")
    assert (exported.max_batch_size, exported.instance_group[0].count) == (tc.GPU_MAX_BATCH_SIZE, tc.GPU_INSTANCES)


def test_the_variants_labels_can_be_named_on_the_command_line():
    labels = [variant.label for variant in VARIANTS]
    assert len(set(labels)) == len(labels) and not any("," in label for label in labels)  # --variants splits on ","
    assert labels[0] == "as exported" and VARIANTS[0] == ServedVariant("as exported", full=True)


def test_the_node_placements_are_read_from_onnx_runtimes_log(tmp_path, exports):
    """Where the GPU check looks for the nodes that keep a CUDA graph from capturing the run; here, without a
    GPU provider, every node is on the CPU."""
    repository = exports.copy("minilm_gpu", tmp_path, as_name="minilm")
    found = cpu_placed_nodes(SimpleNamespace(repository=repository, model="minilm"))
    (placement,) = found["placements"]
    assert re.fullmatch(r"All nodes placed on \[CPUExecutionProvider\]\. Number of nodes: \d+", placement), placement
