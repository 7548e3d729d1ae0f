"""Activation QDQ pairs from int8 to uint8 (zero point + 128, same scale): exact, and ORT's x86 kernels want u8."""
import numpy as np, onnx
from onnx import numpy_helper

def to_u8(model: onnx.ModelProto) -> onnx.ModelProto:
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    readers = {}
    for n in g.node:
        for i in n.input:
            readers.setdefault(i, []).append(n)
    done = set()
    for q in [n for n in g.node if n.op_type == "QuantizeLinear"]:
        if q.input[0] in inits or len(q.input) < 3:
            continue  # weights stay s8
        zp = inits[q.input[2]]
        if zp.data_type != onnx.TensorProto.INT8:
            continue
        dqs = readers.get(q.output[0], [])
        assert dqs and all(d.op_type == "DequantizeLinear" for d in dqs), q.name
        names = {q.input[2]} | {d.input[2] for d in dqs}
        for name in names - done:
            z = numpy_helper.to_array(inits[name]).astype(np.int16) + 128
            new = numpy_helper.from_array(z.astype(np.uint8), name)
            inits[name].CopyFrom(new)
            done.add(name)
    outputs = {q.output[0] for q in g.node if q.op_type == "QuantizeLinear" and q.input[0] not in inits}
    for vi in list(g.value_info) + list(g.output):
        if vi.name in outputs and vi.type.tensor_type.elem_type == onnx.TensorProto.INT8:
            vi.type.tensor_type.elem_type = onnx.TensorProto.UINT8
    return model
