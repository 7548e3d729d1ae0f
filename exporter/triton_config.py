"""Triton ``config.pbtxt`` files, built from Triton's own protobuf schema.

Never from string templates: each config is a typed ``ModelConfig`` message
serialised with ``text_format``, so a misspelt field fails here, not in the server.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as pb

#: Requests Triton may merge into one execution of each step.
MAX_BATCH_SIZE = 64
#: How long a step waits for more requests to merge (microseconds).
QUEUE_DELAY_US = 2000
#: Token batches are padded to a power of two, at least this long, so concurrent
#: requests share few shapes (the encoder's batcher merges equal shapes only).
MIN_PADDED_LENGTH = 16
#: The tokenizer waits longer: every text it collects joins one padded batch.
TOKENIZER_QUEUE_DELAY_US = 5000


@dataclass(frozen=True)
class Tensor:
    name: str
    data_type: int
    dims: tuple[int, ...]


def _io(cls, tensor: Tensor):
    return cls(name=tensor.name, data_type=tensor.data_type, dims=list(tensor.dims))


def _base(name: str, inputs: list[Tensor], outputs: list[Tensor], params: dict[str, str] | None = None,
          batching: bool = True) -> pb.ModelConfig:
    config = pb.ModelConfig(name=name, max_batch_size=MAX_BATCH_SIZE)
    config.input.extend(_io(pb.ModelInput, t) for t in inputs)
    config.output.extend(_io(pb.ModelOutput, t) for t in outputs)
    for key, value in (params or {}).items():
        config.parameters[key].string_value = str(value)
    if batching:
        config.dynamic_batching.max_queue_delay_microseconds = QUEUE_DELAY_US
        config.instance_group.add(kind=pb.ModelInstanceGroup.KIND_CPU, count=1)
    return config


def token_tensors(input_names: list[str]) -> list[Tensor]:
    return [Tensor(name, pb.TYPE_INT64, (-1,)) for name in input_names]


def tokenizer_config(name: str, input_names: list[str], max_length: int, pad_id: int, truncate: bool) -> pb.ModelConfig:
    config = _base(name, [Tensor("TEXT", pb.TYPE_STRING, (1,))], token_tensors(input_names), {
        "max_length": max_length, "pad_id": pad_id, "truncate": str(truncate).lower(),
        "min_padded_length": MIN_PADDED_LENGTH,
    })
    config.backend = "python"
    config.dynamic_batching.max_queue_delay_microseconds = TOKENIZER_QUEUE_DELAY_US
    return config


def encoder_config(name: str, input_names: list[str], hidden_size: int) -> pb.ModelConfig:
    config = _base(name, token_tensors(input_names),
                   [Tensor("last_hidden_state", pb.TYPE_FP32, (-1, hidden_size))])
    config.platform = "onnxruntime_onnx"
    config.default_model_filename = "model.onnx"
    warmup = config.model_warmup.add(name="warmup", batch_size=1)
    for input_name in input_names:
        warmup.inputs[input_name].CopyFrom(
            pb.ModelWarmup.Input(data_type=pb.TYPE_INT64, dims=[16], zero_data=True))
    return config


def postprocess_config(name: str, hidden_size: int, pooling: str, normalize: bool) -> pb.ModelConfig:
    config = _base(
        name,
        [Tensor("last_hidden_state", pb.TYPE_FP32, (-1, hidden_size)), Tensor("attention_mask", pb.TYPE_INT64, (-1,))],
        [Tensor("EMBEDDING", pb.TYPE_FP32, (hidden_size,))],
        {"pooling": pooling, "normalize": str(normalize).lower()},
    )
    config.backend = "python"
    return config


def ensemble_config(name: str, task: str, tokenizer: str, encoder: str, postprocess: str,
                    input_names: list[str], hidden_size: int) -> pb.ModelConfig:
    """Raw strings in, the task's output out: tokenizer -> encoder -> postprocess."""
    config = _base(name, [Tensor("TEXT", pb.TYPE_STRING, (1,))],
                   [Tensor("EMBEDDING", pb.TYPE_FP32, (hidden_size,))], {"task": task}, batching=False)
    config.platform = "ensemble"
    steps = config.ensemble_scheduling.step
    tokens = {n: f"_{n}" for n in input_names}
    steps.add(model_name=tokenizer, model_version=-1, input_map={"TEXT": "TEXT"}, output_map=tokens)
    steps.add(model_name=encoder, model_version=-1, input_map=tokens, output_map={"last_hidden_state": "_hidden"})
    steps.add(model_name=postprocess, model_version=-1,
              input_map={"last_hidden_state": "_hidden", "attention_mask": tokens["attention_mask"]},
              output_map={"EMBEDDING": "EMBEDDING"})
    return config


def write(config: pb.ModelConfig, model_dir: Path) -> Path:
    path = model_dir / "config.pbtxt"
    path.write_text(text_format.MessageToString(config))
    return path


def read(path: Path) -> pb.ModelConfig:
    return text_format.Parse(path.read_text(), pb.ModelConfig())
