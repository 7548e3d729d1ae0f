"""A sentence-transformers folder as the export reads it (exporter/export/st_folder.py, embedders.py, pooling.py,
source.py), against what sentence-transformers itself computes from the same folder.

Seeded tiny folders (the tiny BERT of helpers/tiny_models.py with Pooling, Dense, LayerNorm and Normalize
modules) are saved by sentence-transformers and then read by the export: for each variant either the
export's pooling (the numpy embedder validation applies, and the same ops appended to a graph and run by
ONNX Runtime) gives sentence-transformers' ``encode`` from the encoder's token states, or the export
refuses the folder with an error that names what it cannot reproduce.  Then the trained length, the
lowercasing and the pickle policy.  No export runs: every check reads the folder or a one-node graph.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper
from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer import modules

from nexus_sli.exporter.errors import CheckpointError, NexusError, UnsafeCheckpointError
from nexus_sli.exporter.export import st_folder
from nexus_sli.exporter.export.checkpoint import Checkpoint
from nexus_sli.exporter.export.embedders import ModelFolder, poolers
from nexus_sli.exporter.export.source import lowercased, tokenizer_file
from nexus_sli.exporter.triton.python_models.encoding import load_tokenizer
from nexus_sli.tasks import get_task
from helpers.tiny_models import COMMON, VOCAB, quiet_session

HIDDEN, POSITIONS = COMMON["hidden_size"], COMMON["max_position_embeddings"]
TASK = get_task("embedding")
#: rows of different lengths, so that every batch has padding
TEXTS = ["a", "the quick brown fox jumps over the lazy dog", "validation texts of several lengths", "", "one two"]
#: the bar of every vector against sentence-transformers' (fp32 sums in another order; float64 Dense arithmetic)
ATOL = RTOL = 1e-5


def _save(folder, checkpoint, *after_transformer) -> str:
    """A sentence-transformers folder of the tiny BERT and ``after_transformer`` modules, seeded wide enough that
    an activation sees values past its linear range."""
    torch.manual_seed(3)
    with torch.no_grad():
        for module in after_transformer:
            for parameter in module.parameters():
                parameter.uniform_(-1.0, 1.0)
    transformer = modules.Transformer(str(checkpoint), max_seq_length=64)
    SentenceTransformer(modules=[transformer, *after_transformer], device="cpu").save(str(folder))
    return folder


def _edit(file, **changes) -> None:
    file.write_text(json.dumps({**(json.loads(file.read_text()) if file.is_file() else {}), **changes}))


def _pooling_config(folder, config: dict) -> None:
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": HIDDEN, **config}))


def _states_graph(path, states: str) -> None:
    """A graph that answers its input token states as ``states``: what an encoder graph gives the pooling."""
    graph = helper.make_graph(
        [helper.make_node("Identity", ["hidden"], [states])], "states",
        [helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["batch", "sequence", HIDDEN]),
         helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "sequence"])],
        [helper.make_tensor_value_info(states, TensorProto.FLOAT, ["batch", "sequence", HIDDEN])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))


def _exported_and_reference(folder, tmp_path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(the export's numpy embedder, its in-graph pooling, sentence-transformers' encode) on :data:`TEXTS`,
    the export's two from the Transformer module's token states."""
    st = SentenceTransformer(str(folder), device="cpu")
    expected = st.encode(TEXTS, batch_size=len(TEXTS), convert_to_numpy=True)
    features = st.preprocess(TEXTS)
    with torch.no_grad():
        hidden = st[0](dict(features))["token_embeddings"].numpy()
    mask = features["attention_mask"].numpy().astype(np.int64)
    assert (mask == 0).any(), "the batch must hold padding"
    embedder, pooling = poolers(ModelFolder(folder, TASK, HIDDEN, VOCAB, max_positions=POSITIONS))
    _states_graph(tmp_path / "states.onnx", pooling.states)
    pooled = pooling.append(tmp_path / "states.onnx", tmp_path / "pooled.onnx")
    graph = quiet_session(pooled).run([pooling.output], {"hidden": hidden, "attention_mask": mask})[0]
    return embedder(hidden, mask), graph, expected


def _assert_matches(folder, tmp_path) -> None:
    ours, graph, expected = _exported_and_reference(folder, tmp_path)
    np.testing.assert_allclose(ours, expected, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(graph, expected, rtol=RTOL, atol=ATOL)


@pytest.fixture(scope="module")
def bert(tiny_checkpoint):
    return tiny_checkpoint("bert")


# --- pooling ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("config", [
    {"pooling_mode": "cls"}, {"pooling_mode": "mean"}, {"pooling_mode": "max"}, {"pooling_mode": ["max"]},
    {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False},
    {"pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": False},
    {"pooling_mode_max_tokens": True},
    # the newer key wins over the older flags, in sentence-transformers as in the export
    {"pooling_mode": "cls", "pooling_mode_mean_tokens": True},
    # the size a config states is only reported by sentence-transformers: it pools whatever the states hold
    {"pooling_mode": "mean", "word_embedding_dimension": 7}, {"pooling_mode": "max", "embedding_dimension": 7},
], ids=lambda config: "-".join(f"{k}={v}" for k, v in config.items()))
def test_each_pooling_mode_gives_sentence_transformers_vectors(tmp_path, bert, config):
    folder = _save(tmp_path / "model", bert, modules.Pooling(HIDDEN, "mean"))
    _pooling_config(folder, config)
    _assert_matches(folder, tmp_path)


@pytest.mark.parametrize("config, named", [
    ({"pooling_mode": "mean_sqrt_len_tokens"}, "mean_sqrt_len_tokens"),
    ({"pooling_mode": "weightedmean"}, "weightedmean"),
    ({"pooling_mode": "lasttoken"}, "lasttoken"),
    ({"pooling_mode_weightedmean_tokens": True}, "weightedmean"),
    ({"pooling_mode_lasttoken": True}, "lasttoken"),
    # several modes: sentence-transformers concatenates their vectors (its own saves keep them as a list)
    ({"pooling_mode": ["cls", "mean"]}, r"cls \+ mean"),
    ({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": True}, r"cls \+ mean"),
    ({"pooling_mode_mean_tokens": False}, "none"),
], ids=lambda value: value if isinstance(value, str) else "-".join(f"{k}={v}" for k, v in value.items()))
def test_a_pooling_the_export_does_not_reproduce_is_refused_by_name(tmp_path, config, named):
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    _pooling_config(tmp_path, config)
    with pytest.raises(NexusError, match=f"unsupported pooling {named} in .*1_Pooling"):
        st_folder.pooling_mode(tmp_path)


# --- Dense, LayerNorm, Normalize -------------------------------------------------------------------

PIPELINES = {
    "no-bias-identity": lambda: [modules.Pooling(HIDDEN, "mean"),
                                 modules.Dense(HIDDEN, 20, bias=False, activation_function=torch.nn.Identity())],
    "two-dense-relu-sigmoid": lambda: [modules.Pooling(HIDDEN, "max"),
                                       modules.Dense(HIDDEN, 24, activation_function=torch.nn.ReLU()),
                                       modules.Dense(24, 8, activation_function=torch.nn.Sigmoid())],
    "tokens-dense-cls-dense-layernorm-normalize": lambda: [
        modules.Dense(HIDDEN, 16, module_input_name="token_embeddings"),  # Tanh, the default
        modules.Pooling(16, "cls"), modules.Dense(16, 16, activation_function=torch.nn.Tanh(), use_residual=True),
        modules.LayerNorm(16), modules.Normalize()],
}


@pytest.mark.parametrize("name", PIPELINES)
def test_dense_layer_norm_and_normalize_give_sentence_transformers_vectors(tmp_path, bert, name):
    _assert_matches(_save(tmp_path / "model", bert, *PIPELINES[name]()), tmp_path)


def test_a_normalize_of_the_token_states_is_refused(tmp_path, bert):
    # after the pooling it leaves the sentence embedding as it is: normalising that would change the vectors
    folder = _save(tmp_path / "model", bert, modules.Pooling(HIDDEN, "mean"),
                   modules.Normalize(module_input_name="token_embeddings"))
    vectors = SentenceTransformer(str(folder), device="cpu").encode(TEXTS[:2])
    assert not np.allclose(np.linalg.norm(vectors, axis=1), 1.0)
    with pytest.raises(NexusError, match="Normalize module reads 'token_embeddings'"):
        poolers(ModelFolder(folder, TASK, HIDDEN, VOCAB, max_positions=POSITIONS))


ST = "sentence_transformers.models."


@pytest.mark.parametrize("types, named", [
    ([ST + "Transformer", ST + "WordWeights", ST + "Pooling"], "WordWeights"),
    ([ST + "Transformer", ST + "CNN", ST + "Pooling"], "CNN"),
    ([ST + "Transformer", ST + "LSTM", ST + "Pooling"], "LSTM"),
    ([ST + "StaticEmbedding"], "StaticEmbedding"),
    ([ST + "Router"], "Router"),
    ([ST + "Asym"], "Asym"),
    ([ST + "Transformer", ST + "Pooling", ST + "Dropout", ST + "Dense"], "Dropout"),
    ([ST + "Transformer", ST + "LayerNorm", ST + "Pooling"], "LayerNorm, Pooling"),
    ([ST + "Transformer", ST + "Pooling", ST + "Normalize", ST + "Dense"], "Normalize, Dense"),
    ([ST + "Transformer", ST + "Pooling", ST + "WeightedLayerPooling"], "WeightedLayerPooling"),
    # a model's own code under a familiar class name may compute anything
    (["custom_st.Transformer", ST + "Pooling"], "custom_st.Transformer"),
    ([ST + "Transformer", "my_package.Pooling"], "my_package.Pooling"),
])
def test_modules_the_export_does_not_reproduce_are_refused_by_name(tmp_path, types, named):
    (tmp_path / "modules.json").write_text(json.dumps(
        [{"idx": i, "name": str(i), "path": "" if i == 0 else f"{i}_{t.rsplit('.', 1)[-1]}", "type": t}
         for i, t in enumerate(types)]))
    for read in (st_folder.pooling_mode, st_folder.dense_modules):
        with pytest.raises(NexusError, match=named):
            read(tmp_path)


@pytest.mark.parametrize("settings, message", [
    ({"transformer_task": "fill-mask"}, "runs the task 'fill-mask'"),
    ({"modality_config": {"text": {"method": "forward", "method_output_name": "pooler_output"}}},
     "reads the model's 'pooler_output'"),
    # sentence-transformers then truncates every text at 5 tokens, whatever max_seq_length says
    ({"processing_kwargs": {"text": {"max_length": 5}}}, "processing_kwargs .*max_length"),
    ({"processing_kwargs": {"common": {"add_special_tokens": False}}}, "processing_kwargs .*add_special_tokens"),
])
def test_a_transformer_that_reads_or_tokenizes_otherwise_is_refused(tmp_path, bert, settings, message):
    folder = _save(tmp_path / "model", bert, modules.Pooling(HIDDEN, "mean"))
    _edit(folder / "sentence_bert_config.json", **settings)
    with pytest.raises(NexusError, match=message):
        st_folder.pooling_mode(folder)


def test_the_transformer_settings_sentence_transformers_saves_are_accepted(tmp_path, bert):
    folder = _save(tmp_path / "model", bert, modules.Pooling(HIDDEN, "mean"))
    _edit(folder / "sentence_bert_config.json", processing_kwargs={"image": {"size": 4}})  # not read for texts
    assert json.loads((folder / "sentence_bert_config.json").read_text())["modality_config"]
    assert st_folder.pooling_mode(folder) == "mean"


# --- length, lowercasing, pickles ------------------------------------------------------------------

@pytest.fixture(scope="module")
def plain(tmp_path_factory, bert):
    """A mean-pooling folder whose length the tests below set (its files saved without one)."""
    folder = _save(tmp_path_factory.mktemp("plain") / "model", bert, modules.Pooling(HIDDEN, "mean"))
    config = json.loads((folder / "sentence_bert_config.json").read_text())
    config.pop("max_seq_length", None)
    (folder / "sentence_bert_config.json").write_text(json.dumps(config))
    _edit(folder / "tokenizer_config.json", model_max_length=int(1e30))  # transformers' "no limit"
    return folder


@pytest.mark.parametrize("settings, tokenizer_length, expected", [
    ({}, None, POSITIONS),                           # no length anywhere: the model's positions
    ({}, 50, 50),                                    # the tokenizer's
    ({"max_seq_length": 20}, 50, 20),                # the Transformer module's wins
    ({"max_seq_length": 40}, 30, 40),                # ... even past the tokenizer's
    ({"max_seq_length": 20, "file": "sentence_roberta_config.json"}, 50, 20),  # an older release's file name
])
def test_the_trained_length_is_where_sentence_transformers_truncates(tmp_path, plain, settings, tokenizer_length,
                                                                     expected):
    folder = tmp_path / "model"
    shutil.copytree(plain, folder)
    settings = dict(settings)
    file = settings.pop("file", "sentence_bert_config.json")
    if file != "sentence_bert_config.json":
        (folder / file).write_text((folder / "sentence_bert_config.json").read_text())
        (folder / "sentence_bert_config.json").unlink()
    _edit(folder / file, **settings)
    if tokenizer_length is not None:
        _edit(folder / "tokenizer_config.json", model_max_length=tokenizer_length)
    assert SentenceTransformer(str(folder), device="cpu").max_seq_length == expected
    assert st_folder.trained_length(folder, POSITIONS) == expected


def test_a_length_past_the_positions_is_cut_to_them(tmp_path, plain):
    folder = tmp_path / "model"
    shutil.copytree(plain, folder)
    _edit(folder / "sentence_bert_config.json", max_seq_length=4 * POSITIONS)
    assert st_folder.trained_length(folder, POSITIONS) == POSITIONS


@pytest.mark.parametrize("cased", [True, False], ids=["cased-tokenizer", "lowercasing-tokenizer"])
def test_do_lower_case_is_served_as_sentence_transformers_tokenizes(tmp_path, plain, cased):
    from tokenizers import Tokenizer, normalizers

    folder = tmp_path / "model"
    shutil.copytree(plain, folder)
    if cased:  # in both files: transformers builds a BertTokenizer's normalizer from tokenizer_config.json
        tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        tokenizer.normalizer = normalizers.BertNormalizer(lowercase=False)
        tokenizer.save(str(folder / "tokenizer.json"))
        _edit(folder / "tokenizer_config.json", do_lower_case=False)
    texts = ["The QUICK Brown Fox", "ÉCOLE and Paris"]
    served = load_tokenizer(str(tokenizer_file(folder, tmp_path)), POSITIONS)
    before = [encoding.ids for encoding in served.encode_batch(texts)]
    unlowered = SentenceTransformer(str(folder), device="cpu").preprocess(texts)["input_ids"].tolist()
    assert [row[:len(ids)] for row, ids in zip(unlowered, before)] == before
    _edit(folder / "sentence_bert_config.json", do_lower_case=True)
    reference = SentenceTransformer(str(folder), device="cpu").preprocess(texts)["input_ids"].tolist()
    served = load_tokenizer(str(tokenizer_file(folder, tmp_path)), POSITIONS)
    got = [encoding.ids for encoding in served.encode_batch(texts)]
    assert [row[:len(ids)] for row, ids in zip(reference, got)] == got
    assert [len(ids) for ids in got] == [sum(1 for i in row if i != 0) for row in reference]
    assert (before != got) == cased  # a cased tokenizer reads other tokens unless the texts are lowercased


@pytest.mark.parametrize("cased_file", ["tokenizer.json", "tokenizer.json, the config silent",
                                       "tokenizer.json, accents kept", "tokenizer_config.json"])
def test_a_bert_normalizer_is_served_as_tokenizer_config_states_it(tmp_path, plain, cased_file):
    """transformers sets a BERT tokenizer's normalizer from tokenizer_config.json, whatever tokenizer.json says:
    where the two disagree on lowercasing or accents, the served tokens are transformers' (and
    sentence-transformers'); a key the config leaves out is the tokenizer class's default."""
    from tokenizers import Tokenizer, normalizers
    from transformers import AutoTokenizer

    folder = tmp_path / "model"
    shutil.copytree(plain, folder)
    if cased_file.startswith("tokenizer.json"):
        tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        kept = cased_file.endswith("accents kept")
        tokenizer.normalizer = normalizers.BertNormalizer(lowercase=kept, strip_accents=False if kept else None)
        tokenizer.save(str(folder / "tokenizer.json"))
        config = json.loads((folder / "tokenizer_config.json").read_text())
        for key in ("do_lower_case", "strip_accents"):
            config.pop(key, None)
        config["tokenizer_class"] = "BertTokenizerFast"
        if cased_file == "tokenizer.json":
            config["do_lower_case"] = True
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    else:
        _edit(folder / "tokenizer_config.json", do_lower_case=False, tokenizer_class="BertTokenizer")
    texts = ["The QUICK Brown Fox", "ÉCOLE and Paris", "lower case words", "café crème"]
    raw = load_tokenizer(str(folder / "tokenizer.json"), POSITIONS)
    served = load_tokenizer(str(tokenizer_file(folder, tmp_path)), POSITIONS)
    expected = AutoTokenizer.from_pretrained(str(folder))(texts)["input_ids"]
    assert [encoding.ids for encoding in served.encode_batch(texts)] == expected
    assert [encoding.ids for encoding in raw.encode_batch(texts)] != expected  # the case this test is about
    assert SentenceTransformer(str(folder), device="cpu").preprocess(texts)["input_ids"][:, 0].tolist() == [
        ids[0] for ids in expected]


def test_a_tokenizer_that_lowercases_already_is_served_as_it_is(tmp_path):
    from tokenizers import Tokenizer, normalizers

    from helpers.tiny_models import train_tokenizer

    tokenizer = train_tokenizer(["a few words", "to train on"])
    tokenizer.normalizer = normalizers.Sequence([normalizers.NFD(), normalizers.Lowercase()])
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    assert lowercased(tmp_path / "tokenizer.json", tmp_path) == tmp_path / "tokenizer.json"
    assert not (tmp_path / "lowercased-tokenizer.json").exists()
    tokenizer.normalizer = normalizers.NFD()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    served = Tokenizer.from_file(str(lowercased(tmp_path / "tokenizer.json", tmp_path)))
    assert served.normalizer.normalize_str("ÀB") == "a\u0300b"


def test_pickled_module_weights_are_read_only_where_allowed(tmp_path, bert):
    from safetensors.torch import load_file

    folder = _save(tmp_path / "model", bert, modules.Pooling(HIDDEN, "mean"), modules.Dense(HIDDEN, 8))
    for weights in (folder / "model.safetensors", folder / "2_Dense" / "model.safetensors"):  # as older saves
        torch.save(load_file(str(weights)), weights.with_name("pytorch_model.bin"))
        weights.unlink()
    with pytest.raises(UnsafeCheckpointError, match=r"2_Dense/pytorch_model.bin is a pickle file.*--allow-pickle"):
        st_folder.dense_modules(folder)
    with pytest.raises(UnsafeCheckpointError, match="only pickle weights.*--allow-pickle"):
        Checkpoint(folder)
    _, after = st_folder.dense_modules(folder, allow_pickle=True)
    assert [module.out_features for module in after] == [8]


def test_a_pickled_checkpoint_with_a_missing_shard_names_it(tmp_path):
    torch.save({"a": torch.zeros(2)}, tmp_path / "pytorch_model-00001-of-00002.bin")
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": {
        "a": "pytorch_model-00001-of-00002.bin", "b": "pytorch_model-00002-of-00002.bin"}}))
    with pytest.raises(CheckpointError, match="lists shards that are missing: pytorch_model-00002-of-00002.bin"):
        Checkpoint(tmp_path, allow_pickle=True)
