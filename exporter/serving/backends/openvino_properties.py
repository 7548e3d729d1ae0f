"""OpenVINO CPU properties from the parameters of a Triton OpenVINO-backend config.

One home for the mapping: the ``openvino`` backend shim compiles served models
with it, and the exporter validates and times them with it.
"""

#: Parameters of Triton's native OpenVINO backend passed on to the CPU plugin as they are.
PASSED_ON = ("INFERENCE_NUM_THREADS", "NUM_STREAMS", "PERFORMANCE_HINT")


def compile_properties(params: dict) -> dict:
    properties = {key: params[key] for key in PASSED_ON if params.get(key)}
    properties.setdefault("PERFORMANCE_HINT", "LATENCY")
    # OpenVINO's CPU plugin picks bf16 by itself on AMX machines: f32, which the
    # exporter validated, unless bf16 was asked for (and validated) with HINT_BF16.
    properties["INFERENCE_PRECISION_HINT"] = "bf16" if params.get("HINT_BF16", "").upper() == "YES" else "f32"
    return properties
