"""Triton ``config.pbtxt`` files, built from Triton's own protobuf schema.

Never from string templates: each config is a typed ``ModelConfig`` message
serialised with ``text_format``, so a misspelt field fails here, not in the
server.  :func:`layout` turns a task spec's tensors into the four models' inputs
and outputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as pb

from nexus_sli.client.error_codes import DECODED_OUTPUT, IDS_INPUT, TOKEN_COUNT_OUTPUT, TOKENS_OUTPUT
from nexus_sli.exporter.errors import NexusError
from nexus_sli.tasks import get_task, spec
from nexus_sli.tasks.model_parameters import TASK, Prompts, TokenizerParameters

#: Requests Triton may merge into one execution of each step of a CPU repository, and the most texts
#: a client sends in one request.
MAX_BATCH_SIZE = 64
#: The same for a GPU repository.  A GPU runs the rows of a batch side by side (an execution of 256 short
#: texts costs about what one of 32 does), so a client's batch of 256 is one request and one execution,
#: and concurrent calls merge into executions of up to 256 rows.  Chosen on a GPU among the variants
#: bench/gpu_served.py serves (docs/gpu.md, "Served on a GPU").
GPU_MAX_BATCH_SIZE = 256
#: The most rows ``--max-batch-size`` may ask for: the gateway's largest call (``GatewayConfig.max_inputs``,
#: OpenAI's limit), as one request.
MAX_ROWS_ASKED = 2048
#: Instances of a GPU encoder (each a CUDA context and a session on that GPU; with ``nexus-sli serve``, each
#: one process that also tokenizes): while one tokenizes and copies, the other computes.  Two, not four:
#: four carried more short calls at once but no more calls of 256, held more GPU memory and made a
#: single query slower (as above).
GPU_INSTANCES = 2
#: How long a GPU encoder waits for more requests to merge (microseconds).  None: a lone query would pay
#: it, and under load requests queue while the instances run and merge then anyway (as above).
GPU_QUEUE_DELAY_US = 0
#: A CPU encoder does not wait: its time grows with the rows it runs, so waiting
#: only delays a lone query, and under load it merges what queued while it ran
#: (bench/data/tried.md, "The CPU encoder's queue delay").
CPU_QUEUE_DELAY_US = 0
#: The python steps do not wait: a lone query would pay every step's delay, while
#: the encoder merges what the tokenizer sends regardless, and under load each step
#: still merges what queued while it ran (bench/data/tried.md, "Where a single
#: query's time goes").
TOKENIZER_QUEUE_DELAY_US = 0
POSTPROCESS_QUEUE_DELAY_US = 0
#: The most requests one step's queue holds; past it Triton refuses a request at once (the client's
#: ``ServerBusyError``) instead of queueing work nobody will wait for.  Above what one gateway admits at
#: its defaults (32 requests of up to 2048 texts, each sent as chunks of MAX_BATCH_SIZE: 1024 requests),
#: twice over, for direct clients or a second gateway beside it: the bound refuses a burst, never
#: the load a gateway admitted (bench/data/tried.md, "Triton's queue policy").
MAX_QUEUE_SIZE = 2048
#: How long a request may wait in one step's queue before Triton drops it unrun (microseconds): the
#: client's and the gateway's default deadline for a whole call, so what is dropped is work its caller
#: has stopped waiting for.  A request may ask for less (``allow_timeout_override``).
QUEUE_TIMEOUT_US = 60_000_000
#: Every token row that fits is padded to this width (or the model's limit when shorter),
#: so all such requests share one shape and the encoder's batcher merges them; longer
#: ones pad to the next doubling.  The encoder cuts each batch to its longest real token.
PAD_WIDTH = 512
#: Overlap, in tokens, between consecutive windows of a long QA context.
QA_STRIDE = 32


#: The parameter keys Triton's ONNX Runtime backend reads for each GPU execution
#: accelerator (triton-inference-server/onnxruntime_backend README, "ONNX Runtime with
#: TensorRT optimization" and "... with CUDA Execution Provider optimization").  The
#: parameters are a free string map: a misspelt key passes protobuf and Triton silently.
ACCELERATOR_KEYS: dict[str, frozenset[str]] = {
    "tensorrt": frozenset({
        "precision_mode", "max_workspace_size_bytes", "trt_max_partition_iterations", "trt_min_subgraph_size",
        "int8_calibration_table_name", "int8_use_native_calibration_table", "trt_dla_enable", "trt_dla_core",
        "trt_engine_cache_enable", "trt_engine_cache_path", "trt_engine_cache_prefix", "trt_dump_subgraphs",
        "trt_force_sequential_engine_build", "trt_context_memory_sharing_enable", "trt_layer_norm_fp32_fallback",
        "trt_timing_cache_enable", "trt_timing_cache_path", "trt_force_timing_cache", "trt_detailed_build_log",
        "trt_build_heuristics_enable", "trt_sparsity_enable", "trt_builder_optimization_level",
        "trt_auxiliary_streams", "trt_tactic_sources", "trt_extra_plugin_lib_paths", "trt_profile_min_shapes",
        "trt_profile_max_shapes", "trt_profile_opt_shapes", "trt_cuda_graph_enable", "trt_dump_ep_context_model",
        "trt_ep_context_file_path", "trt_ep_context_embed_mode"}),
    "cuda": frozenset({"cudnn_conv_use_max_workspace", "use_ep_level_unified_stream"}),
}


@dataclass(frozen=True)
class Accelerator:
    """One GPU execution accelerator of the ONNX Runtime backend (``gpu_execution_accelerator``)."""

    name: str
    parameters: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class EncoderServing:
    """What a runtime target puts into the encoder's ``config.pbtxt``: exactly one of
    ``platform`` (Triton's name for an ONNX Runtime model) or ``backend``."""

    platform: str = ""
    backend: str = ""
    parameters: dict[str, str] = field(default_factory=dict)
    #: the instance group's kind (``ModelInstanceGroup.Kind`` name)
    device: str = "KIND_CPU"
    accelerators: tuple[Accelerator, ...] = ()
    #: the widths the tokenizer pads a batch to (the smallest that fits); empty: :data:`PAD_WIDTH`, whose
    #: padding the graph cuts off itself (each doubled up to the model's limit: :meth:`widths`)
    pad_widths: tuple[int, ...] = ()
    #: the rows asked for by the export (``--max-batch-size``); None: the device's default
    rows: int | None = None

    @property
    def queue_delay_us(self) -> int:
        """How long the encoder's batcher waits for requests to merge: the device decides."""
        return GPU_QUEUE_DELAY_US if self.device == "KIND_GPU" else CPU_QUEUE_DELAY_US

    @property
    def max_batch_size(self) -> int:
        """The rows one execution of each step of the repository may merge, and the most texts a client
        sends in one request: the export's ``rows``, else the device's default."""
        if self.rows is not None:
            return self.rows
        return GPU_MAX_BATCH_SIZE if self.device == "KIND_GPU" else MAX_BATCH_SIZE

    @property
    def instances(self) -> int:
        """The encoder's instances: the device decides."""
        return GPU_INSTANCES if self.device == "KIND_GPU" else 1

    def widths(self, max_length: int) -> list[int]:
        """The tokenizer's pad widths for a model that takes ``max_length`` tokens.  They go on doubling past the
        largest up to ``max_length``: a 600-token text of an 8192-token model pads its batch to 1024 positions,
        not 8192 (the arrays each step passes on, and a CPU graph's padding the trim cuts, 8 times smaller)."""
        widths = {min(w, max_length) for w in self.pad_widths or (PAD_WIDTH,)}
        width = max(widths)
        while width < max_length:
            width = min(2 * width, max_length)
            widths.add(width)
        return sorted(widths)


@dataclass(frozen=True)
class Tensor:
    name: str
    data_type: int
    dims: tuple[int, ...]


@dataclass(frozen=True)
class Layout:
    """The tensors of one task's ensemble.  Dims exclude the batch dimension
    when ``batched``; otherwise rows are explicit (one request = one query)."""

    batched: bool
    mode: str                       # the tokenizer model's mode
    inputs: tuple[Tensor, ...]      # raw strings into the ensemble and the tokenizer
    tokens: tuple[Tensor, ...]      # tokenizer outputs: graph inputs plus extras
    encoder_outputs: tuple[Tensor, ...]
    post_inputs: tuple[str, ...]    # names taken from inputs, tokens and encoder outputs
    outputs: tuple[Tensor, ...]     # the postprocess's, and the ensemble's, outputs
    #: the encoder's outputs are the ensemble's (an embedding graph that pools, export/pooling.py):
    #: no post-processing step
    encoder_answers: bool = False
    #: the token states a graph that pools keeps beside its answer (an encoder output the task's
    #: ensemble does not map; the second ensemble, :func:`token_ensemble_config`, does)
    token_states: Tensor | None = None
    #: each row's token count, which the tokenizer step answers and the ensemble maps beside the results
    #: where the task reports usage (``TaskSpec.usage``; None: not answered)
    token_count: Tensor | None = None
    #: results the tokenizer step answers (``TaskSpec.token_results``): (result name, tokenizer output)
    echoed: tuple[tuple[str, str], ...] = ()

    def rows(self, tensor: Tensor) -> Tensor:
        """``tensor`` as a step of this layout sees it (an explicit row dim when unbatched)."""
        return tensor if self.batched else Tensor(tensor.name, tensor.data_type, (-1, *tensor.dims))

    @property
    def computed(self) -> tuple[Tensor, ...]:
        """The results the encoder or the post-processing makes (the others are the tokenizer's, :attr:`echoed`)."""
        echoed = {result for result, _ in self.echoed}
        return tuple(t for t in self.outputs if t.name not in echoed)

    @property
    def counts(self) -> tuple[Tensor, ...]:
        """The token count as the tokenizer step and the ensemble declare it; empty where not answered."""
        return (self.rows(self.token_count),) if self.token_count else ()

    def tensor(self, name: str) -> Tensor:
        for t in self.inputs:
            if t.name == name:
                return t
        return self.rows(next(t for t in (*self.tokens, *self.encoder_outputs) if t.name == name))


def _tensor(tensor: spec.Tensor, hidden_size: int, num_labels: int, vocab_size: int = 0,
            embedded_size: int = 0) -> Tensor:
    resolved = tensor.resolved(hidden_size, num_labels, vocab_size, embedded_size)
    return Tensor(resolved.name, pb.DataType.Value(f"TYPE_{resolved.dtype}"), resolved.dims)


def layout(task: str, input_names: list[str], hidden_size: int, num_labels: int, pooled: bool = False,
           vocab_size: int = 0, embedded_size: int = 0) -> Layout:
    """The ensemble's tensors for ``task``, read from its spec (:mod:`nexus_sli.tasks`).

    ``pooled``: the encoder graph ends in the pooling and answers the task's results itself
    (``[batch, hidden]`` embeddings, ``[batch, vocab]`` sparse ones), so the ensemble is tokenizer ->
    encoder; where the task keeps its token states (``token_states``), the encoder answers them too.
    ``embedded_size``: the embedding's size where the model's Dense modules project it (0: the hidden size)."""
    task_spec = get_task(task)
    convert = lambda tensors: tuple(_tensor(t, hidden_size, num_labels, vocab_size, embedded_size)  # noqa: E731
                                    for t in tensors)
    ids = tuple(Tensor(n, pb.TYPE_INT64, (-1,)) for n in input_names)
    # a tokenizer output may be a graph input too (a pooled graph's scoring mask): one tensor
    extras = tuple(t for t in convert(task_spec.token_extras) if t.name not in input_names)
    results = convert(task_spec.results)
    echoed = {result for result, _ in task_spec.token_results}
    states = convert((task_spec.token_states,))[0] if pooled and task_spec.token_states else None
    computed = tuple(t for t in results if t.name not in echoed)
    encoder_outputs = (*computed, *([states] if states else [])) if pooled else convert(task_spec.encoder_outputs)
    count = Tensor(TOKEN_COUNT_OUTPUT, pb.TYPE_INT64, (1,)) if task_spec.usage else None
    return Layout(task_spec.batched, task_spec.tokenizer_mode, convert(task_spec.inputs), (*ids, *extras),
                  encoder_outputs, () if pooled else task_spec.post_inputs, results, encoder_answers=pooled,
                  token_states=states, token_count=count, echoed=task_spec.token_results)


def _io(cls, tensor: Tensor):
    return cls(name=tensor.name, data_type=tensor.data_type, dims=list(tensor.dims))


def _model(name: str, inputs, outputs, batched: bool, params: dict | None, queue_delay_us: int,
           max_batch_size: int = MAX_BATCH_SIZE) -> pb.ModelConfig:
    config = pb.ModelConfig(name=name, max_batch_size=max_batch_size if batched else 0)
    config.input.extend(_io(pb.ModelInput, t) for t in inputs)
    config.output.extend(_io(pb.ModelOutput, t) for t in outputs)
    for key, value in (params or {}).items():
        config.parameters[key].string_value = str(value)
    config.instance_group.add(kind=pb.ModelInstanceGroup.KIND_CPU, count=1)
    if batched:
        config.dynamic_batching.SetInParent()  # batching on even where the delay is 0 (proto3's default)
        config.dynamic_batching.max_queue_delay_microseconds = queue_delay_us
        config.dynamic_batching.default_queue_policy.CopyFrom(queue_policy())
    return config


def queue_policy() -> pb.ModelQueuePolicy:
    """Every batching step's queue: bounded, its requests dropped past a timeout a request may shorten."""
    return pb.ModelQueuePolicy(max_queue_size=MAX_QUEUE_SIZE, default_timeout_microseconds=QUEUE_TIMEOUT_US,
                               timeout_action=pb.ModelQueuePolicy.REJECT, allow_timeout_override=True)


def tokenizer_config(name: str, lay: Layout, max_length: int, pad_id: int, truncate: bool,
                     pad_widths: list[int] | None = None, prompts: Prompts | None = None,
                     sides: str | None = None, max_batch_size: int = MAX_BATCH_SIZE) -> pb.ModelConfig:
    """``prompts``: the model's named prompts, applied by the step; ``sides``: a late-interaction model's two
    sides (``python_models/sides.py``'s ``Sides.to_json()``), which the ``sided`` mode reads;
    ``max_batch_size``: the encoder's (:attr:`EncoderServing.max_batch_size`)."""
    params = TokenizerParameters(
        lay.mode, max_length, pad_id, truncate, tuple(pad_widths or [min(PAD_WIDTH, max_length)]),
        stride=QA_STRIDE if lay.mode == "qa" else 0, sides=sides, prompts=prompts or Prompts(),
        # one request becomes many encoder rows: the tokenizer refuses more than it takes
        max_rows=None if lay.batched else max_batch_size).write()
    config = _model(name, lay.inputs, [*(lay.rows(t) for t in lay.tokens), *lay.counts], lay.batched, params,
                    TOKENIZER_QUEUE_DELAY_US, max_batch_size)
    config.backend = "python"
    if lay.mode in ("single", "sided"):
        _text_modes(config)
    return config


def _text_modes(config: pb.ModelConfig) -> None:
    """The tokenizer's text modes (``tokenizer_model.py``): ``TOKENS`` for texts, asked for by name, and
    ``IDS`` in place of ``TEXT``, answered by ``DECODED``.  Both inputs are optional so that a request sends
    one; the ensembles send ``TEXT`` and map only the token tensors, as before."""
    for model_input in config.input:
        model_input.optional = True
    config.input.add(name=IDS_INPUT, data_type=pb.TYPE_INT64, dims=[-1], optional=True)
    config.output.add(name=TOKENS_OUTPUT, data_type=pb.TYPE_STRING, dims=[1])
    config.output.add(name=DECODED_OUTPUT, data_type=pb.TYPE_STRING, dims=[1])


def encoder_config(name: str, lay: Layout, input_names: list[str], serving: EncoderServing,
                   model_filename: str = "model.onnx", max_length: int = PAD_WIDTH) -> pb.ModelConfig:
    inputs = [t for t in lay.tokens if t.name in input_names]
    config = _model(name, inputs, lay.encoder_outputs, True, serving.parameters, serving.queue_delay_us,
                    serving.max_batch_size)
    if serving.platform:
        config.platform = serving.platform
    else:
        config.backend = serving.backend
    config.instance_group[0].kind = pb.ModelInstanceGroup.Kind.Value(serving.device)
    config.instance_group[0].count = serving.instances
    _accelerate(config, serving.accelerators, input_names, max_length)
    config.default_model_filename = model_filename
    warmup = config.model_warmup.add(name="warmup", batch_size=1)
    for tensor in inputs:
        warmup.inputs[tensor.name].CopyFrom(pb.ModelWarmup.Input(data_type=pb.TYPE_INT64, dims=[16], zero_data=True))
    return config


def profile_dims(max_length: int, max_batch_size: int = MAX_BATCH_SIZE) -> dict[str, tuple[int, int]]:
    """TensorRT's optimization profile over (batch, sequence), from the model's limits: one row of
    one token, up to ``max_batch_size`` rows of ``max_length``; tuned for a quarter of the batch at
    128 tokens.  One home for the ONNX Runtime accelerator's profile and ``nexus-sli build-plan``'s."""
    return {"min": (1, 1), "opt": (max(1, max_batch_size // 4), min(128, max_length)),
            "max": (max_batch_size, max_length)}


def profile_shapes(input_names: list[str], max_length: int, max_batch_size: int = MAX_BATCH_SIZE) -> dict[str, str]:
    """:func:`profile_dims` as the ONNX Runtime backend's ``trt_profile_*_shapes`` parameters."""
    return {f"trt_profile_{kind}_shapes": ",".join(f"{name}:{batch}x{length}" for name in input_names)
            for kind, (batch, length) in profile_dims(max_length, max_batch_size).items()}


def _accelerate(config: pb.ModelConfig, accelerators, input_names: list[str], max_length: int) -> None:
    """The GPU execution accelerators, their keys checked against :data:`ACCELERATOR_KEYS`."""
    for accelerator in accelerators:
        parameters = dict(accelerator.parameters)
        if accelerator.name == "tensorrt":
            parameters.update(profile_shapes(input_names, max_length, config.max_batch_size))
        unknown = set(parameters) - ACCELERATOR_KEYS.get(accelerator.name, frozenset())
        if accelerator.name not in ACCELERATOR_KEYS or unknown:
            raise ValueError(f"accelerator {accelerator.name!r} with keys {sorted(unknown)} is not one Triton's "
                             f"ONNX Runtime backend reads: {sorted(ACCELERATOR_KEYS)}")
        entry = config.optimization.execution_accelerators.gpu_execution_accelerator.add(name=accelerator.name)
        entry.parameters.update(parameters)


def postprocess_config(name: str, lay: Layout, params: dict[str, str],
                       max_batch_size: int = MAX_BATCH_SIZE) -> pb.ModelConfig:
    config = _model(name, [lay.tensor(n) for n in lay.post_inputs], lay.computed, lay.batched, params,
                    POSTPROCESS_QUEUE_DELAY_US, max_batch_size)
    config.backend = "python"
    return config


def ensemble_config(name: str, task: str, lay: Layout, input_names: list[str], steps: tuple[str, ...],
                    params: dict[str, str], max_batch_size: int = MAX_BATCH_SIZE) -> pb.ModelConfig:
    """Raw strings in, the task's output out: tokenizer -> encoder -> postprocess, or
    tokenizer -> encoder where the encoder answers (``lay.encoder_answers``; ``steps`` has two).
    The tokenizer's token count, where it answers one (``lay.counts``), is an output too, after the task's;
    so are the tokenizer outputs a task answers (``lay.echoed``), which the later steps read under that name."""
    config = pb.ModelConfig(name=name, max_batch_size=max_batch_size if lay.batched else 0, platform="ensemble")
    config.input.extend(_io(pb.ModelInput, t) for t in lay.inputs)
    config.output.extend(_io(pb.ModelOutput, t) for t in (*lay.outputs, *lay.counts))
    for key, value in {TASK.key: task, **params}.items():
        config.parameters[key].string_value = str(value)
    internal = {t.name: f"_{t.name}" for t in (*lay.tokens, *lay.encoder_outputs)}
    internal |= {token: result for result, token in lay.echoed}
    external = {t.name: t.name for t in lay.inputs}
    if len(steps) != (2 if lay.encoder_answers else 3):
        raise ValueError(f"the {task} ensemble takes {2 if lay.encoder_answers else 3} steps, not {list(steps)}")
    tokenizer, encoder, *postprocess = steps
    step = config.ensemble_scheduling.step
    step.add(model_name=tokenizer, model_version=-1, input_map=external,
             output_map={**{t.name: internal[t.name] for t in lay.tokens}, **{t.name: t.name for t in lay.counts}})
    if lay.encoder_answers:  # the encoder's outputs are the ensemble's
        step.add(model_name=encoder, model_version=-1, input_map={n: internal[n] for n in input_names},
                 output_map={t.name: t.name for t in lay.computed})
        return config
    step.add(model_name=encoder, model_version=-1, input_map={n: internal[n] for n in input_names},
             output_map={t.name: internal[t.name] for t in lay.encoder_outputs})
    step.add(model_name=postprocess[0], model_version=-1,
             input_map={n: {**internal, **external}[n] for n in lay.post_inputs},
             output_map={t.name: t.name for t in lay.computed})
    return config


def token_ensemble_config(name: str, lay: Layout, input_names: list[str], steps: tuple[str, str],
                          params: dict[str, str], max_batch_size: int = MAX_BATCH_SIZE) -> pb.ModelConfig:
    """The second ensemble of a graph that keeps its token states (``lay.token_states``): raw strings in,
    tokenizer -> the same encoder, out the token states ``[-1, hidden]`` and the tokenizer's attention
    mask (:data:`spec.TOKEN_MASK`), by which a client cuts each text's real tokens."""
    if lay.token_states is None:
        raise ValueError(f"ensemble {name}: the encoder keeps no token states to serve")
    mask = _tensor(spec.TOKEN_MASK, 0, 0)
    config = pb.ModelConfig(name=name, max_batch_size=max_batch_size if lay.batched else 0, platform="ensemble")
    config.input.extend(_io(pb.ModelInput, t) for t in lay.inputs)
    config.output.extend(_io(pb.ModelOutput, t) for t in (lay.token_states, mask))
    for key, value in {TASK.key: spec.TOKEN_TASK, **params}.items():
        config.parameters[key].string_value = str(value)
    # the tokenizer's mask is both the encoder's input and this ensemble's output
    internal = {t.name: f"_{t.name}" for t in lay.tokens} | {"attention_mask": mask.name}
    tokenizer, encoder = steps
    step = config.ensemble_scheduling.step
    step.add(model_name=tokenizer, model_version=-1, input_map={t.name: t.name for t in lay.inputs},
             output_map={t.name: internal[t.name] for t in lay.tokens})
    step.add(model_name=encoder, model_version=-1, input_map={n: internal[n] for n in input_names},
             output_map={lay.token_states.name: lay.token_states.name})
    return config


def write(config: pb.ModelConfig, model_dir: Path) -> Path:
    model_dir.mkdir(parents=True, exist_ok=True)
    path = model_dir / "config.pbtxt"
    path.write_text(text_format.MessageToString(config))
    return path


class ConfigError(NexusError, text_format.ParseError):
    """A ``config.pbtxt`` that Triton's configuration schema, as this install has it, does not read: one line
    from the CLI, and still a ``ParseError`` to the code that skips such configs."""


def read(path: Path) -> pb.ModelConfig:
    try:
        return text_format.Parse(path.read_text(), pb.ModelConfig())
    except text_format.ParseError as exc:
        raise ConfigError(f"{path} is not a model configuration Triton's schema reads: {exc}") from exc
