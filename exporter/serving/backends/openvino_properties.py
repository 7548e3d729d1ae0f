"""OpenVINO CPU properties from the parameters of a Triton OpenVINO-backend config.

One home for the mapping: the ``openvino`` backend shim compiles served models
with it, and the exporter validates and times them with it.
"""

if __package__:  # imported from the nexus_sli package (the exporter's validation and timing)
    from nexus_sli.tasks.model_parameters import HINT_BF16, INFERENCE_NUM_THREADS, NUM_STREAMS, PERFORMANCE_HINT
else:  # a file copied beside the shim's model.py
    from model_parameters import HINT_BF16, INFERENCE_NUM_THREADS, NUM_STREAMS, PERFORMANCE_HINT

#: Parameters of Triton's native OpenVINO backend passed on to the CPU plugin as they are.
PASSED_ON = tuple(parameter.key for parameter in (INFERENCE_NUM_THREADS, NUM_STREAMS, PERFORMANCE_HINT))


def compile_properties(params: dict) -> dict:
    properties = {key: params[key] for key in PASSED_ON if params.get(key)}
    properties.setdefault(PERFORMANCE_HINT.key, "LATENCY")
    # OpenVINO's CPU plugin picks bf16 by itself on AMX machines: f32, which the
    # exporter validated, unless bf16 was asked for (and validated) with HINT_BF16.
    properties["INFERENCE_PRECISION_HINT"] = "bf16" if HINT_BF16.read(params, "").upper() == "YES" else "f32"
    return properties
