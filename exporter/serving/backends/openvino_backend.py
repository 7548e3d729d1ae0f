"""A Python-based Triton backend named ``openvino``.

The PyPI Triton build has no native OpenVINO backend; installed as
``<backend-dir>/openvino/model.py`` (with the modules it shares beside it:
``backend_folders._shim`` copies them) this serves ``backend: "openvino"`` models, an
ONNX file or an OpenVINO IR (``model.xml`` + ``model.bin``), with the
openvino package.  It reads the parameters of Triton's native OpenVINO
backend, so the same repository runs on an NGC container:

- ``HINT_BF16`` ``YES``: bf16 inference precision (on CPUs with bf16);
  anything else keeps f32, which the exporter validated;
- ``INFERENCE_NUM_THREADS``, ``NUM_STREAMS``, ``PERFORMANCE_HINT``: passed on;
- ``WARMUP_QUERY_TOKENS`` (ours; default :data:`WARMUP_QUERY_TOKENS`): one query
  of every length up to this many tokens is run at load.

Why the warm-up: OpenVINO's CPU plugin prepares its kernels for each new input
shape on the first run at that shape, so that run is slower than its repeats,
for one query most of all (ONNX Runtime's is not; bench/data/tried.md,
"OpenVINO's first run at a new input shape").  So every new query length would
be a slow query, a p99 nobody chose.  Batches' shapes (rows x length) are too
many to warm; each pays its slower first run once per process.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # the shared modules beside this file

import numpy as np  # noqa: E402
import openvino as ov  # noqa: E402
from encoder_backend import EncoderBackend  # noqa: E402
from model_parameters import WARMUP_QUERY_TOKENS as WARMUP_PARAMETER  # noqa: E402
from openvino_properties import compile_properties  # noqa: E402

#: Query lengths (tokens, special tokens included) warmed at load: most search queries fit.
WARMUP_QUERY_TOKENS = 32


def embedding_rows(model):
    """The rows of the table ``input_ids`` index (the vocabulary), found by following the ids' values (not
    their shape: a position table is indexed by a range of it) to a Gather of a 2-D table; None where none is."""
    starts = [p for p in model.get_parameters() if "input_ids" in p.output(0).get_names()]
    seen, waiting = set(), starts[:1]
    while waiting:
        node = waiting.pop()
        for target in node.output(0).get_target_inputs():
            consumer = target.get_node()
            if consumer.get_type_name() == "Gather" and target.get_index() == 1:
                table = consumer.input_value(0).get_partial_shape()
                if table.rank.is_static and table.rank.get_length() == 2 and table[0].is_static:
                    return table[0].get_length()
            name = consumer.get_friendly_name()
            if consumer.get_type_name() != "ShapeOf" and consumer.get_output_size() == 1 and name not in seen:
                seen.add(name)
                waiting.append(consumer)
    return None


class TritonPythonModel(EncoderBackend):
    def load(self, path, params):
        core = ov.Core()
        model = core.read_model(str(path))
        # OpenVINO's Gather answers zeros for an index past its table, where ONNX Runtime fails the request
        self.vocab_size = embedding_rows(model)
        self.compiled = core.compile_model(model, "CPU", compile_properties(params))
        self.request = self.compiled.create_infer_request()
        # by every name of each output: OpenVINO merges the names of the tensors its transformations fold
        # together (an ONNX output behind an Identity node also bears its producer's name), and its
        # get_any_name() is the first of them in sorted order, not necessarily the graph output's name
        self.ports = {name: output for output in self.compiled.outputs for name in output.get_names()}
        self.warm_up(WARMUP_PARAMETER.read(params, WARMUP_QUERY_TOKENS))

    def warm_up(self, tokens):
        """Run one row of each length 1..``tokens``: real token ids (1) and a full mask, so
        the encoder backend's cut to the real length leaves the shape as warmed."""
        names = [port.get_any_name() for port in self.compiled.inputs]
        for length in range(1, tokens + 1):
            self.request.infer({name: np.full((1, length), 0 if name == "token_type_ids" else 1, dtype=np.int64)
                                for name in names})

    def infer(self, feeds, names):
        # the inputs are read where they lie, not copied: the arrays are contiguous and outlive the run;
        # the outputs are the request's own buffers, which it reuses on the next run: copy out only what
        # was asked for
        results = self.request.infer(feeds, share_inputs=True, share_outputs=True)
        return {name: results[self.ports[name]].copy() for name in names}
