"""The runtime-target registry: every registered target keeps the contract the pipeline relies on."""

from __future__ import annotations

import pytest
from tritonclient.grpc import model_config_pb2 as pb

from nexus_sli.exporter.errors import NexusError
from nexus_sli.exporter.export.validate import LABEL_THRESHOLDS, THRESHOLDS
from nexus_sli.exporter.targets import (AUTO_CONFIGURATIONS, DEVICES, TARGETS, configurations_for, get_target, register,
                                        serving_target)
from nexus_sli.exporter.triton import config as tc

TARGET_NAMES = sorted(TARGETS)


def test_the_cpu_targets_are_registered():
    assert {"onnxruntime", "openvino"} <= set(TARGETS)


@pytest.mark.parametrize("name", TARGET_NAMES)
def test_every_precision_of_a_target_has_default_thresholds(name):
    target = TARGETS[name]
    assert target.precisions, f"{name} offers no precision"
    for precision in target.precisions:
        assert precision in THRESHOLDS and precision in LABEL_THRESHOLDS


@pytest.mark.parametrize("name", TARGET_NAMES)
def test_a_target_writes_a_servable_encoder_config(name):
    target = TARGETS[name]
    lay = tc.layout("embedding", ["input_ids", "attention_mask"], 8, 0)
    for precision in target.precisions:
        serving = target.serving(precision)
        assert bool(serving.platform) != bool(serving.backend), "exactly one of platform or backend"
        config = tc.encoder_config(f"{name}_encoder", lay, ["input_ids", "attention_mask"], serving)
        assert (config.platform, config.backend) == (serving.platform, serving.backend)
        assert config.instance_group[0].kind == pb.ModelInstanceGroup.Kind.Value(serving.device)
        assert dict((k, v.string_value) for k, v in config.parameters.items()) == serving.parameters
        found = serving_target(config.platform, config.backend, serving.device)
        # the GPU targets differ only in the accelerator: either opens the other's graph alike
        assert found is target or (found.device, type(found).open) == (target.device, type(target).open)


def test_auto_lists_registered_configurations_and_one_every_cpu_runs_at_parity():
    assert set(AUTO_CONFIGURATIONS) == set(DEVICES)
    for device, listed in AUTO_CONFIGURATIONS.items():
        for name, precision in listed:
            assert precision in get_target(name).precisions and get_target(name).device == device
    # a CPU without any fast path still gets ONNX Runtime fp32, which every family exports at parity
    assert ("onnxruntime", "fp32") in [(c.target.name, c.precision) for c in configurations_for("auto", "auto", set())]


def test_auto_configurations_are_held_to_the_auto_bar_and_named_ones_are_not():
    assert all(c.auto for c in configurations_for("auto", "auto", set()))
    assert all(c.auto for c in configurations_for("openvino", "auto", set()))
    assert not any(c.auto for c in configurations_for("auto", "int8", set()))  # int8 asked for: its own bar
    assert not any(c.auto for c in configurations_for("onnxruntime", "fp32", set()))


def test_a_second_registration_under_one_name_is_refused():
    with pytest.raises(ValueError, match="registered twice"):
        register(TARGETS["onnxruntime"])
    assert TARGETS["onnxruntime"].name == "onnxruntime"


def test_unknown_backend_and_precision_errors_list_the_choices():
    with pytest.raises(NexusError, match="onnxruntime, openvino"):
        configurations_for("tensorflow", "fp32")
    with pytest.raises(NexusError, match="fp32, int8, bf16"):
        configurations_for("auto", "fp8")
    with pytest.raises(NexusError, match="serves precision fp32, int8, not 'bf16'"):
        configurations_for("onnxruntime", "bf16")
    with pytest.raises(NexusError, match="no runtime target serves"):
        serving_target("tensorflow_savedmodel", "")
