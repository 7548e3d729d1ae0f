"""JinaBERT v2, NeoBERT and GTE v1.5 / mGTE: the project's own layer code against the published math.

The references below are written here with plain torch functional ops straight
from the published code (jinaai/jina-bert-implementation ``modeling_bert.py``,
chandar-lab/NeoBERT ``model.py`` / ``rotary.py``, Alibaba-NLP/new-impl
``modeling.py``), read from the raw checkpoint tensors, so the project's
modules are checked against something other than themselves.  The exports then
go through the real pipeline and its validation.
"""

from __future__ import annotations

import json
import logging
import math
import shutil

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from nexus_sli.exporter.export import export_report
from nexus_sli.exporter.export.checkpoint import Checkpoint
from nexus_sli.exporter.errors import CheckpointError, NexusError, UnsupportedModelError
from nexus_sli.exporter.export.pipeline import ExportOptions, run_export
from nexus_sli.exporter.export.families import FAMILIES, family_for
from nexus_sli.exporter.export.families.jinabert_model import JinaBertLayer, alibi_slopes
from nexus_sli.exporter.export.source import load_config
from nexus_sli.tasks import get_task
from nexus_sli.exporter.export.walk import walk
from helpers.tiny_remote_models import (
    MAX_LENGTH,
    NUM_LABELS,
    REMOTE_TINY,
    TASKS,
    build_tiny_remote,
    neobert_ffn_size,
    tiny_config,
)

EXPORTS = [(family, "embedding", "fp32") for family in REMOTE_TINY] + \
          [(family, "embedding", "int8") for family in REMOTE_TINY] + \
          [(family, "classification", "fp32") for family in REMOTE_TINY]


@pytest.fixture(scope="module")
def remote_checkpoint(tmp_path_factory, tiny_tokenizer):
    """``remote_checkpoint("neobert", "classification", feed_forward_type=...)`` -> directory (built once)."""
    built = {}

    def make(model_type: str, task: str = "embedding", **overrides):
        key = (model_type, task, json.dumps(overrides, sort_keys=True))  # overrides may hold dicts
        if key not in built:
            directory = tmp_path_factory.mktemp(f"{model_type}-{task}")
            built[key] = build_tiny_remote(model_type, directory, tiny_tokenizer, task=task, **overrides)
        return built[key]

    return make


@pytest.fixture(scope="module")
def exported(remote_checkpoint, tmp_path_factory):
    """``exported(family, task, precision)`` -> (repository directory, result), each export run once."""
    done = {}

    def make(model_type: str, task: str, precision: str):
        key = (model_type, task, precision)
        if key not in done:
            out = tmp_path_factory.mktemp(f"repo-{model_type}-{task}-{precision}")
            result = run_export(ExportOptions(model=str(remote_checkpoint(model_type, task)), task=task,
                                              precision=precision, name="tiny", out=out))
            done[key] = (out, result)
        return done[key]

    return make


# -- references from the published formulas ------------------------------------------------------


def paper_alibi_slopes(n: int) -> list[float]:
    """Press et al.: ``2^(-8k/n)``, k = 1..n, for a power of two; otherwise the nearest
    lower power of two plus the odd-numbered slopes of the next one."""
    if n & (n - 1) == 0:
        return [2.0 ** (-8.0 * k / n) for k in range(1, n + 1)]
    lower = 1 << (n.bit_length() - 1)
    return paper_alibi_slopes(lower) + paper_alibi_slopes(2 * lower)[0::2][: n - lower]


def jina_reference(w: dict, c: dict, ids, mask, types, task: str) -> torch.Tensor:
    """jina-bert-implementation, SDPA path: post-norm BERT layers, ALiBi added to the mask."""
    h, n, eps, inter = c["hidden_size"], c["num_attention_heads"], c["layer_norm_eps"], c["intermediate_size"]
    prefix = "bert." if task == "classification" else ""
    batch, seq = ids.shape

    def lin(x, name):
        return F.linear(x, w[prefix + name + ".weight"], w.get(prefix + name + ".bias"))

    def norm(x, name):
        return F.layer_norm(x, (h,), w[prefix + name + ".weight"], w[prefix + name + ".bias"], eps)

    x = norm(w[prefix + "embeddings.word_embeddings.weight"][ids]
             + w[prefix + "embeddings.token_type_embeddings.weight"][types], "embeddings.LayerNorm")
    slopes = torch.tensor(paper_alibi_slopes(n))
    pos = torch.arange(seq)
    alibi = -slopes[:, None, None] * (pos[None, :] - pos[:, None]).abs()
    bias = alibi.expand(batch, n, seq, seq).masked_fill(~mask.bool()[:, None, None, :], float("-inf"))
    for i in range(c["num_hidden_layers"]):
        p = f"encoder.layer.{i}."
        q, k, v = (lin(x, p + "attention.self." + t).view(batch, seq, n, h // n).transpose(1, 2)
                   for t in ("query", "key", "value"))
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=bias).transpose(1, 2).reshape(batch, seq, h)
        a = norm(lin(ctx, p + "attention.output.dense") + x, p + "attention.output.LayerNorm")
        if c["feed_forward_type"] in ("geglu", "reglu"):
            hidden = lin(a, p + "mlp.gated_layers")
            gated, non_gated = hidden[:, :, :inter], hidden[:, :, inter:]
            act = F.gelu if c["feed_forward_type"] == "geglu" else F.relu
            x = norm(lin(act(gated) * non_gated, p + "mlp.wo") + a, p + "mlp.layernorm")
        else:
            x = norm(lin(F.gelu(lin(a, p + "intermediate.dense")), p + "output.dense") + a, p + "output.LayerNorm")
    if task == "classification":
        pooled = torch.tanh(lin(x[:, 0], "pooler.dense"))
        return F.linear(pooled, w["classifier.weight"], w["classifier.bias"])
    return x


def neobert_reference(w: dict, c: dict, ids, mask, task: str) -> torch.Tensor:
    """NeoBERT model.py: complex-number RoPE (precompute_freqs_cis / apply_rotary_emb), SDPA, SwiGLU."""
    h, n, eps = c["hidden_size"], c["num_attention_heads"], c["norm_eps"]
    d = h // n
    batch, seq = ids.shape
    freqs = 1.0 / (10000.0 ** (torch.arange(0, d, 2)[: d // 2].float() / d))
    angles = torch.outer(torch.arange(seq), freqs).float()
    freqs_cis = torch.polar(torch.ones_like(angles), angles)[None, :, None, :]

    def rope(x):
        return torch.view_as_real(torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2)) * freqs_cis).flatten(3)

    keep = mask.bool()[:, None, None, :].expand(batch, n, seq, seq)
    x = w["model.encoder.weight"][ids]
    for i in range(c["num_hidden_layers"]):
        p = f"model.transformer_encoder.{i}."
        xq, xk, xv = F.linear(F.rms_norm(x, (h,), w[p + "attention_norm.weight"], eps),
                              w[p + "qkv.weight"]).view(batch, seq, n, 3 * d).chunk(3, dim=-1)
        attn = F.scaled_dot_product_attention(rope(xq).transpose(1, 2), rope(xk).transpose(1, 2),
                                              xv.transpose(1, 2), attn_mask=keep).transpose(1, 2)
        x = x + F.linear(attn.reshape(batch, seq, h), w[p + "wo.weight"])
        a, b = F.linear(F.rms_norm(x, (h,), w[p + "ffn_norm.weight"], eps), w[p + "ffn.w12.weight"]).chunk(2, dim=-1)
        x = x + F.linear(F.silu(a) * b, w[p + "ffn.w3.weight"])
    x = F.rms_norm(x, (h,), w["model.layer_norm.weight"], eps)
    if task == "classification":
        pooled = torch.tanh(F.linear(x[:, 0], w["dense.weight"], w["dense.bias"]))
        return F.linear(pooled, w["classifier.weight"], w["classifier.bias"])
    return x


def gte_inv_freq(c: dict) -> torch.Tensor:
    """new-impl's rotary frequencies: ``RotaryEmbedding``'s, which ``NTKScalingRotaryEmbedding`` replaces when
    it caches its tables past ``max_position_embeddings`` (a factor above 1): fixed NTK (eq. 6 of its source)
    or mixed (eqs. 10, 12, 13)."""
    d = c["hidden_size"] // c["num_attention_heads"]
    base, scaling = c["rope_theta"], c.get("rope_scaling") or {}
    factor, mixed_b = scaling.get("factor", 1.0), scaling.get("mixed_b")
    inv_freq = 1.0 / (base ** (torch.arange(0, d, 2).float() / d))
    if factor > 1 and mixed_b is None:
        inv_freq = 1.0 / ((base * factor) ** (torch.arange(0, d, 2).float() / d)) / factor ** (2 / d)
    elif factor > 1:
        a = torch.tensor(factor).log() / (d / 2) ** mixed_b
        inv_freq = inv_freq / (a * torch.arange(1, d // 2 + 1).float() ** mixed_b).exp()
    return inv_freq


def gte_reference(w: dict, c: dict, ids, mask, types, task: str) -> torch.Tensor:
    """new-impl modeling.py, eager path: post-norm layers, rotary tables cached to the scaled limit and read at
    each position, ``rotate_half``, the gated MLP's ``[up | gate]``, ``NewPooler`` for classification."""
    h, n, eps, inter = c["hidden_size"], c["num_attention_heads"], c["layer_norm_eps"], c["intermediate_size"]
    d, (batch, seq) = h // n, ids.shape
    prefix = "new." if task == "classification" else ""

    def lin(x, name):
        return F.linear(x, w[prefix + name + ".weight"], w.get(prefix + name + ".bias"))

    def norm(x, name):
        return F.layer_norm(x, (h,), w[prefix + name + ".weight"], w[prefix + name + ".bias"], eps)

    def rotate_half(t):
        return torch.cat((-t[..., d // 2:], t[..., : d // 2]), dim=-1)

    x = w[prefix + "embeddings.word_embeddings.weight"][ids]
    if c["type_vocab_size"] > 0:
        x = x + w[prefix + "embeddings.token_type_embeddings.weight"][types]
    x = norm(x, "embeddings.LayerNorm")
    cached = int(c["max_position_embeddings"] * (c.get("rope_scaling") or {}).get("factor", 1))
    freqs = torch.einsum("i,j->ij", torch.arange(cached, dtype=torch.float32), gte_inv_freq(c))
    table = torch.cat((freqs, freqs), dim=-1)[torch.arange(seq)]
    cos, sin = table.cos()[None, :, None, :], table.sin()[None, :, None, :]
    keep = mask.bool()[:, None, None, :].expand(batch, n, seq, seq)
    for i in range(c["num_hidden_layers"]):
        p = f"encoder.layer.{i}."
        q, k, v = (t.view(batch, seq, n, d) for t in lin(x, p + "attention.qkv_proj").split(h, dim=-1))
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        ctx = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=keep).transpose(1, 2).reshape(batch, seq, h)
        x = norm(x + lin(ctx, p + "attention.o_proj"), p + "attn_ln")
        up, gate = lin(x, p + "mlp.up_gate_proj").split(inter, dim=-1)
        x = norm(x + lin(F.gelu(gate) * up, p + "mlp.down_proj"), p + "mlp_ln")
    if task == "classification":
        pooled = torch.tanh(lin(x[:, 0], "pooler.dense"))
        return F.linear(pooled, w["classifier.weight"], w["classifier.bias"])
    return x


def padded_batch(lengths: list[int], seed: int = 3):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 400, (len(lengths), max(lengths)), generator=generator)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        mask[row, :length] = 1
    ids = ids.masked_fill(mask == 0, 0)
    types = (torch.arange(ids.shape[1]) >= ids.shape[1] // 2).long().expand_as(ids) * mask
    return ids, mask, types


def walked(directory, task: str):
    config = load_config(directory)
    with Checkpoint(directory) as checkpoint:
        model, _, report = walk(config, checkpoint, get_task(task))
    return model.eval(), report


# -- tests -------------------------------------------------------------------------------------


def test_alibi_slopes_follow_the_paper():
    assert alibi_slopes(8) == pytest.approx([2.0 ** -k for k in range(1, 9)])
    twelve = alibi_slopes(12)  # jina-embeddings-v2-base: 12 heads, not a power of two
    assert twelve[:8] == pytest.approx(alibi_slopes(8))
    assert twelve[8:] == pytest.approx([2.0 ** -(k + 0.5) for k in range(4)])
    for heads in (1, 4, 6, 12, 16):
        assert alibi_slopes(heads) == pytest.approx(paper_alibi_slopes(heads))


@pytest.mark.parametrize("model_type", REMOTE_TINY)
@pytest.mark.parametrize("task", TASKS)
def test_walk_loads_every_published_tensor(model_type, task, remote_checkpoint):
    directory = remote_checkpoint(model_type, task)
    model, report = walked(directory, task)
    names = set(load_file(str(directory / "model.safetensors")))
    skipped = {key for keys in report.skipped.values() for key in keys}
    assert report.layers_loaded == 2 and not report.absent_optional
    if model_type == "neobert" and task == "embedding":  # saved as NeoBERTLMHead
        assert skipped == {"decoder.weight", "decoder.bias"}
    else:
        assert not skipped
    assert report.tensors_loaded == len(names) - len(skipped)
    if model_type == "neobert":  # the SwiGLU width is 2/3 of intermediate_size, rounded up to 8
        block = model.base_model.transformer_encoder[0]
        assert tuple(block.ffn.w12.weight.shape) == (2 * neobert_ffn_size(64), 32) == (96, 32)


@pytest.mark.parametrize("model_type", REMOTE_TINY)
@pytest.mark.parametrize("task", TASKS)
def test_module_matches_reference_from_raw_weights(model_type, task, remote_checkpoint):
    directory = remote_checkpoint(model_type, task)
    model, _ = walked(directory, task)
    weights = load_file(str(directory / "model.safetensors"))
    config = json.loads((directory / "config.json").read_text())
    ids, mask, types = padded_batch([37, 20, 9, 2])
    with torch.no_grad():
        if model_type == "jinabert":
            got = model(input_ids=ids, attention_mask=mask, token_type_ids=types, return_dict=True)
            expected = jina_reference(weights, config, ids, mask, types, task)
        elif model_type == "gte":  # one segment at most (mGTE's type_vocab_size is 1)
            zeros = torch.zeros_like(ids)
            got = model(input_ids=ids, attention_mask=mask, token_type_ids=zeros, return_dict=True)
            expected = gte_reference(weights, config, ids, mask, zeros, task)
        else:
            got = model(input_ids=ids, attention_mask=mask, return_dict=True)
            expected = neobert_reference(weights, config, ids, mask, task)
    output = got.logits if task == "classification" else got.last_hidden_state
    assert output.shape == ((4, NUM_LABELS) if task == "classification" else (4, 37, 32))
    torch.testing.assert_close(output, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("feed_forward_type", ["reglu", "original"])
def test_jinabert_other_feed_forward_types_match_reference(feed_forward_type, remote_checkpoint):
    directory = remote_checkpoint("jinabert", "embedding", feed_forward_type=feed_forward_type)
    model, _ = walked(directory, "embedding")
    weights = load_file(str(directory / "model.safetensors"))
    config = json.loads((directory / "config.json").read_text())
    ids, mask, types = padded_batch([15, 6])
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask, token_type_ids=types).last_hidden_state
    torch.testing.assert_close(got, jina_reference(weights, config, ids, mask, types, "embedding"), atol=1e-5, rtol=0)


@pytest.mark.parametrize("model_type, task, precision", EXPORTS)
def test_export_passes_validation(model_type, task, precision, exported):
    out, result = exported(model_type, task, precision)
    encoder = out / "tiny_encoder"
    report = export_report.read(encoder)
    assert report.validation.passed is True and report.model_type == model_type and report.task == task
    if precision == "fp32":
        assert report.validation.max_abs_diff <= 1e-4
    graph = onnx.load(str(encoder / "1" / "model.onnx")).graph
    inputs = [i.name for i in graph.input]
    segments = model_type == "jinabert" or (model_type == "gte" and task == "classification")  # type_vocab_size
    assert inputs == (["input_ids", "attention_mask", "token_type_ids"] if segments
                      else ["input_ids", "attention_mask"])
    for tensor in graph.input:  # batch and sequence stay dynamic
        assert [d.dim_param for d in tensor.type.tensor_type.shape.dim] == ["batch", "sequence"]


@pytest.mark.parametrize("model_type", REMOTE_TINY)
def test_exported_graph_serves_sequences_longer_than_the_export_example(model_type, exported, remote_checkpoint):
    """ALiBi biases and rotary tables come from the runtime length, not the 16-token example."""
    out, result = exported(model_type, "embedding", "fp32")
    assert result.report.max_length == MAX_LENGTH
    model, _ = walked(remote_checkpoint(model_type), "embedding")
    ids, mask, types = padded_batch([100, 61])
    feeds = {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}
    names = result.report.inputs
    session = ort.InferenceSession(str(out / "tiny_encoder" / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    got = session.run(None, {name: feeds[name].numpy() for name in names})[0]
    with torch.no_grad():
        expected = model(**{name: feeds[name] for name in names}).last_hidden_state.numpy()
    # the graph ends in the pooling (exporter/export/pooling.py): compare with the same pooling in python
    from nexus_sli.exporter.export.validate import Embedder

    assert result.report.pooled_in_graph and got.shape == (2, 32)
    pooled = Embedder(result.report.pooling, result.report.normalize)(expected, mask.numpy())
    assert np.abs(got - pooled).max() <= 1e-4


@pytest.mark.parametrize("model_type, edit, named", [
    ("jinabert", ("encoder.layer.1.mlp.wo.weight", "encoder.layer.1.mlp.w_out.weight"), "encoder.layer.1.mlp.w"),
    ("jinabert", ("embeddings.token_type_embeddings.weight", None), "embeddings.token_type_embeddings.weight"),
    ("neobert", ("model.transformer_encoder.0.ffn.w12.weight", "model.transformer_encoder.0.ffn.w1.weight"),
     "model.transformer_encoder.0.ffn.w12.weight"),
    ("neobert", ("model.layer_norm.weight", None), "layer_norm.weight"),
    ("gte", ("encoder.layer.1.mlp.up_gate_proj.weight", "encoder.layer.1.mlp.gate_up_proj.weight"),
     "encoder.layer.1.mlp."),
    ("gte", ("embeddings.LayerNorm.bias", None), "embeddings.LayerNorm.bias"),
])
def test_missing_or_renamed_tensor_is_a_named_checkpoint_error(model_type, edit, named, remote_checkpoint, tmp_path):
    source = remote_checkpoint(model_type)
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(source / name, tmp_path / name)
    tensors = load_file(str(source / "model.safetensors"))
    old, new = edit
    tensor = tensors.pop(old)
    if new is not None:
        tensors[new] = tensor
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=named.replace(".", r"\.")):
        walked(tmp_path, "embedding")


@pytest.mark.parametrize("model_type", REMOTE_TINY)
def test_other_tasks_name_the_supported_ones(model_type, remote_checkpoint):
    config = load_config(remote_checkpoint(model_type))
    tasks = ", ".join(FAMILIES[model_type].task_models)
    with pytest.raises(NexusError, match=f"supports the tasks {tasks}; task 'question-answering'"):
        FAMILIES[model_type].build_model(get_task("question-answering"), config)


def test_jinabert_layer_class_and_unsupported_variants():
    config = {"model_type": "bert", "architectures": ["JinaBertModel"], "position_embedding_type": "alibi",
              "feed_forward_type": "geglu", "hidden_size": 32, "num_attention_heads": 4, "intermediate_size": 64,
              "num_hidden_layers": 2, "vocab_size": 400}
    layer = FAMILIES["jinabert"].create_layer(config, 0)
    assert isinstance(layer, JinaBertLayer)
    assert {name for name, _ in layer.named_parameters()} >= {"mlp.gated_layers.weight", "mlp.wo.bias",
                                                             "attention.self.query.weight"}
    with pytest.raises(UnsupportedModelError, match="position_embedding_type 'absolute'"):
        FAMILIES["jinabert"].create_layer({**config, "position_embedding_type": "absolute"}, 0)
    with pytest.raises(UnsupportedModelError, match="feed_forward_type 'swiglu'"):
        FAMILIES["jinabert"].create_layer({**config, "feed_forward_type": "swiglu"}, 0)


def test_neobert_max_length_survives_config_loading(remote_checkpoint, caplog):
    family = FAMILIES["neobert"]
    assert family.max_positions({"max_length": 4096}) == 4096
    # transformers 5 pops ``max_length`` (a generation parameter to it) from a plain
    # PretrainedConfig; load_config sets every key of config.json back.
    config = load_config(remote_checkpoint("neobert"))
    expected = json.loads((remote_checkpoint("neobert") / "config.json").read_text())["max_length"]
    assert family.max_positions(config) == expected
    with caplog.at_level(logging.WARNING):
        assert family.max_positions({"hidden_size": 32}) == family.default_max_length == 1024
    assert "no max_length" in caplog.text
    assert math.isclose(config.norm_eps, 1e-5)


def test_a_remote_code_folders_other_files_are_found_from_its_config(remote_checkpoint, tmp_path):
    """A family without a transformers config class is loaded as a plain config, which names its folder as
    ``from_pretrained`` does: a cross-encoder's saved activation beside it is read (sentence-transformers 6)."""
    folder = shutil.copytree(remote_checkpoint("neobert"), tmp_path / "neobert")
    (folder / "config_sentence_transformers.json").write_text(
        json.dumps({"activation_fn": "torch.nn.modules.linear.Identity"}))
    config = load_config(folder)
    assert type(config).__name__.lower() == "pretrainedconfig" and config.name_or_path == str(folder)
    assert get_task("rerank").post_params(config, None)["function_to_apply"] == "none"


def test_gte_is_the_family_of_model_type_new():
    config = tiny_config("gte")
    assert family_for(config["model_type"], config["architectures"], config) is FAMILIES["gte"]
    assert family_for("new", ["NewForSequenceClassification"]).model_type == "gte"


def test_gte_mixed_ntk_scaling_matches_reference(remote_checkpoint):
    directory = remote_checkpoint("gte", "embedding", rope_scaling={"factor": 4.0, "type": "ntk", "mixed_b": 1.5})
    model, _ = walked(directory, "embedding")
    config = json.loads((directory / "config.json").read_text())
    ids, mask, _ = padded_batch([40, 11])
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask).last_hidden_state
    expected = gte_reference(load_file(str(directory / "model.safetensors")), config, ids, mask, None, "embedding")
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    # a factor of 1 leaves the plain rotary frequencies, as the published class does
    unscaled = {**config, "rope_scaling": {"factor": 1.0, "type": "ntk"}}
    plain = FAMILIES["gte"].build_model(get_task("embedding"), {**unscaled, "rope_scaling": None})
    assert torch.equal(FAMILIES["gte"].build_model(get_task("embedding"), unscaled).inv_freq, plain.inv_freq)


@pytest.mark.parametrize("key, value", [("position_embedding_type", "absolute"), ("layer_norm_type", "rms_norm"),
                                        ("pack_qkv", False), ("logn_attention_scale", True),
                                        ("rope_scaling", {"factor": 2.0, "type": "linear"})])
def test_gte_variants_no_published_checkpoint_has_are_refused_by_name(key, value):
    with pytest.raises(UnsupportedModelError, match=key if key != "rope_scaling" else "rope_scaling type 'linear'"):
        FAMILIES["gte"].create_layer(tiny_config("gte", **{key: value}), 0)


def test_gte_reranker_exports_and_validates(tiny_tokenizer, tmp_path):
    """A reranker is a one-label NewForSequenceClassification.  The test tokenizer gives a pair's second text
    segment 1, so this checkpoint has no segment embeddings (type_vocab_size 0) rather than one row a pair
    would index past (an XLM-R tokenizer gives both texts segment 0)."""
    one = {"id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}, "type_vocab_size": 0}
    checkpoint = build_tiny_remote("gte", tmp_path / "ckpt", tiny_tokenizer, task="classification", **one)
    run_export(ExportOptions(model=str(checkpoint), task="rerank", name="tiny", out=tmp_path / "repo"))
    report = export_report.read(tmp_path / "repo" / "tiny_encoder")
    assert report.model_type == "gte" and report.task == "rerank" and report.validation.passed
    assert report.validation.max_abs_diff <= 1e-4
