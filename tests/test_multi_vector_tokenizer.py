"""The tokenizer step's ``sided`` mode against sentence-transformers' ``MultiVectorEncoder``.

``sides.sided_arrays`` over ``tokenizers`` encodings must give, row for row, the token ids, the
attention mask the encoder reads and the scoring mask that ``Transformer.preprocess`` (the prompt,
the side's length, the query expansion) and ``MultiVectorMask`` (expansion scored, skiplist,
``keep_only_token_ids``) give, on seeded tiny ColBERTs.  The tokenizer model itself is loaded as
Triton loads it (its files side by side, the wheel's ``triton_python_backend_utils``) to check that
one execution pads both sides to one width and answers an unknown ``input_type`` alone.
"""

from __future__ import annotations

import json
import string
from dataclasses import dataclass, replace
from importlib import resources
import numpy as np
import pytest
import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from helpers.python_steps import load_step, unload
from nexus_sli.bench.joined_profile import TextRequest
from nexus_sli.client.error_codes import (INPUT_TYPE_PARAMETER, INVALID_INPUT, PROMPT_PARAMETER, TOKEN_COUNT_OUTPUT,
                                          TOKENS_OUTPUT)
from nexus_sli.exporter.triton.models import SHARED_FILES
from nexus_sli.exporter.triton.python_models.encoding import TOKENIZER_MODES
from nexus_sli.exporter.triton.python_models.sides import (
    DOCUMENT,
    QUERY,
    SCORE_MASK,
    SIDE_NAMES,
    Expansion,
    Side,
    Sides,
    side_tokenizers,
    sided_arrays,
    sided_encode,
)
from nexus_sli.tasks import multi_vector

NAMES = ["input_ids", "attention_mask", "token_type_ids", SCORE_MASK]
WORDS = ["the", "cat", "dog", "sat", "on", "mat", "what", "is", "where", "did", "go", "search", "query", "hello",
         "world", "test"]
#: ``[unused0]``/``[unused1]``: Stanford ColBERT's markers, registered as special tokens as its loader does
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "[unused0]", "[unused1]", *string.punctuation, *WORDS,
         *string.ascii_lowercase, *(f"##{c}" for c in string.ascii_lowercase)]
TEXTS = ["cat", "what is a cat?", "the dog sat on the mat.", "hello, world! (a test)",
         "where did the cat go? " * 6]  # the last is longer than every side's length
PROMPTS = {"query": "[unused0] ", "document": "[unused1] ", "search": "search query: "}
PLAIN_PROMPTS = {"query": "[Q] ", "document": "[D] "}  # markers as a native save writes them: plain text


@dataclass(frozen=True)
class Case:
    """One tiny ColBERT's late-interaction settings, as ``Transformer`` and ``MultiVectorMask`` take them."""

    strategy: str | None
    attend: bool = False
    length: int = 10
    query_length: int | None = None
    document_length: int = 16
    skiplist_tasks: tuple[str, ...] = ("document",)
    keep_only: tuple[str, ...] | None = None
    prompts: dict | None = None


CASES = {
    "fixed": Case("fixed", length=12, query_length=12),
    "fixed-attend": Case("fixed", attend=True),
    "min": Case("min", length=8, query_length=14, document_length=20, skiplist_tasks=("query", "document"),
                prompts=PLAIN_PROMPTS),
    "min-attend": Case("min", attend=True, length=10, query_length=10, keep_only=("cat", "dog", "mat", "?")),
    "no-expansion": Case(None, query_length=9, skiplist_tasks=()),
}


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    """A seeded tiny BERT with a WordPiece vocabulary of markers, punctuation, words and letters."""
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordPiece({token: i for i, token in enumerate(VOCAB)}, unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    tokenizer.add_special_tokens([AddedToken(token, normalized=False, special=True) for token in VOCAB[:7]])
    folder = tmp_path_factory.mktemp("tiny-colbert-bert")
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                            sep_token="[SEP]", mask_token="[MASK]",
                            model_input_names=["input_ids", "token_type_ids", "attention_mask"]).save_pretrained(
        str(folder))
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(VOCAB), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=64)
    BertModel(config).eval().save_pretrained(str(folder), safe_serialization=True)
    return folder


def colbert(folder, case: Case):
    """``case`` as a ``MultiVectorEncoder`` (Transformer -> MultiVectorMask) and as the served ``Sides``."""
    from sentence_transformers import MultiVectorEncoder
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.multi_vector_encoder.modules import MultiVectorMask

    expansion = {"strategy": case.strategy, "attend": case.attend, "length": case.length} if case.strategy else None
    transformer = Transformer(str(folder), query_length=case.query_length, document_length=case.document_length,
                              query_expansion=expansion)
    keep = transformer.tokenizer.convert_tokens_to_ids(list(case.keep_only)) if case.keep_only else None
    mask = MultiVectorMask(list(string.punctuation), skiplist_tasks=list(case.skiplist_tasks),
                           keep_only_token_ids=keep)
    model = MultiVectorEncoder(modules=[transformer, mask], device="cpu", prompts=case.prompts or PROMPTS)
    return model, served_sides(model, case, mask, keep)


def served_sides(model, case: Case, mask, keep) -> Sides:
    """What the exporter writes for ``model``: each side's prompt and truncation length, the expansion."""
    expansion, query_length = None, case.query_length
    if case.strategy:
        expansion = Expansion(case.strategy, case.length, model.tokenizer.mask_token_id, case.attend)
        query_length = case.length if case.strategy == "fixed" else max(case.query_length, case.length)
    query = Side(model.prompts["query"], query_length, expansion, QUERY in case.skiplist_tasks)
    document = Side(model.prompts["document"], case.document_length, None, DOCUMENT in case.skiplist_tasks,
                    tuple(keep) if keep else None)
    return Sides(query, document, tuple(int(i) for i in mask._skiplist_ids.tolist()))


def reference_rows(model, texts, side_name, prompt_name=None):
    """Per text, sentence-transformers' ids, the attention mask its encoder read and its scoring mask."""
    read = []
    hook = model[0].register_forward_pre_hook(lambda module, args: read.append(args[0]["attention_mask"].clone()))
    encode = model.encode_query if side_name == QUERY else model.encode_document
    try:
        rows = [encode([text], prompt_name=prompt_name, output_value=None)[0] for text in texts]
    finally:
        hook.remove()
    return [{"input_ids": row["input_ids"].numpy(), "attention_mask": attention[0].numpy(),
             "token_type_ids": row["token_type_ids"].numpy(), SCORE_MASK: row["attention_mask"].numpy()}
            for row, attention in zip(rows, read)]


def assert_rows_match(ours: dict, reference: list, pad_id: int):
    """Each reference row is the start of ours; ours is padding after it."""
    for row, want in enumerate(reference):
        width = len(want["input_ids"])
        for name in NAMES:
            np.testing.assert_array_equal(ours[name][row, :width], want[name].astype(np.int64), err_msg=f"{name} {row}")
            rest = ours[name][row, width:]
            assert (rest == (pad_id if name == "input_ids" else 0)).all(), f"{name} {row} past the text: {rest}"


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
@pytest.mark.parametrize("side_name", [QUERY, DOCUMENT])
def test_sided_arrays_are_what_multi_vector_encoder_computes(tiny_bert, case, side_name):
    model, sides = colbert(tiny_bert, CASES[case])
    tokenizers = side_tokenizers(str(tiny_bert / "tokenizer.json"), sides)
    pad_id = model.tokenizer.pad_token_id
    ours = sided_encode(tokenizers[side_name], TEXTS, side_name, sides, NAMES, pad_id)
    assert_rows_match(ours, reference_rows(model, TEXTS, side_name), pad_id)


@pytest.mark.parametrize("side_name", [QUERY, DOCUMENT])
def test_a_named_prompt_replaces_the_sides_marker(tiny_bert, side_name):
    """sentence-transformers' ``encode_query(prompt_name=...)``: the named prompt instead of the marker,
    the side's length, expansion and skiplist kept."""
    model, sides = colbert(tiny_bert, CASES["fixed-attend"])
    tokenizer = side_tokenizers(str(tiny_bert / "tokenizer.json"), sides)[side_name]
    pad_id = model.tokenizer.pad_token_id
    ours = sided_encode(tokenizer, TEXTS, side_name, sides, NAMES, pad_id, prompt=PROMPTS["search"])
    assert_rows_match(ours, reference_rows(model, TEXTS, side_name, prompt_name="search"), pad_id)


def test_first_token_is_never_scored_where_the_model_drops_it(tiny_bert):
    """BGE-M3's ColBERT vectors are every token's but the first."""
    model, sides = colbert(tiny_bert, CASES["no-expansion"])
    tokenizer = side_tokenizers(str(tiny_bert / "tokenizer.json"), sides)[DOCUMENT]
    encodings = tokenizer.encode_batch(TEXTS)
    width = max(len(e.ids) for e in encodings) + 3
    kept = sided_arrays(encodings, DOCUMENT, sides, NAMES, 0, width)
    dropped = sided_arrays(encodings, DOCUMENT, replace(sides, drop_first=True), NAMES, 0, width)
    assert (dropped[SCORE_MASK][:, 0] == 0).all() and (kept[SCORE_MASK][:, 0] == 1).all()
    np.testing.assert_array_equal(dropped[SCORE_MASK][:, 1:], kept[SCORE_MASK][:, 1:])
    with pytest.raises(ValueError, match="narrower"):
        sided_arrays(encodings, DOCUMENT, sides, NAMES, 0, width - 4)


# -- the tokenizer model, as Triton's python backend loads it -------------------------------------------

@pytest.fixture
def tokenizer_model(tiny_bert, tmp_path, monkeypatch):
    """The sided tokenizer model of ``CASES["fixed"]``, its files copied as an export copies them
    (:mod:`helpers.python_steps`)."""
    version = tmp_path / "1"
    version.mkdir()
    package = resources.files("nexus_sli.exporter.triton.python_models")
    (version / "model.py").write_text(package.joinpath("tokenizer_model.py").read_text())
    for helper in ("encoding.py", "sides.py"):
        (version / helper).write_text(package.joinpath(helper).read_text())
    for shared, file in SHARED_FILES:
        (version / file).write_text(resources.files(shared).joinpath(file).read_text())
    (version / "tokenizer.json").write_bytes((tiny_bert / "tokenizer.json").read_bytes())
    model, sides = colbert(tiny_bert, CASES["fixed"])
    parameters = {"mode": "sided", "sides": sides.to_json(), "prompts": json.dumps(model.prompts), "max_length": "64",
                  "pad_widths": "8,12,16,32", "pad_id": str(model.tokenizer.pad_token_id)}
    config = {"parameters": {key: {"string_value": value} for key, value in parameters.items()},
              "output": [{"name": name} for name in (*NAMES, TOKEN_COUNT_OUTPUT)]}
    yield load_step(monkeypatch, version, "sided_tokenizer_model", config, tmp_path), model, sides
    unload()


def test_sided_is_a_tokenizer_mode():
    assert "sided" in TOKENIZER_MODES


def test_one_execution_pads_both_sides_to_one_width_and_answers_an_unknown_side_alone(tokenizer_model):
    served, model, sides = tokenizer_model
    requests = [TextRequest(TEXTS[:2], **{INPUT_TYPE_PARAMETER: QUERY}), TextRequest(TEXTS[2:]),
                TextRequest(TEXTS[:1], **{INPUT_TYPE_PARAMETER: "passage"}),
                TextRequest(TEXTS[:1], **{INPUT_TYPE_PARAMETER: QUERY, PROMPT_PARAMETER: "search"})]
    query, document, unknown, prompted = served.execute(requests)
    assert unknown.error.startswith(f"[nexus:{INVALID_INPUT}]") and "'passage'" in unknown.error
    assert "query, document" in unknown.error
    assert query.error is document.error is prompted.error is None
    width = document.tensors["input_ids"].shape[1]  # the long document is the widest row of the execution
    assert width == sides.document.max_length == 16
    pad_id = model.tokenizer.pad_token_id
    for answer, texts, side_name, prompt in ((query, TEXTS[:2], QUERY, None), (document, TEXTS[2:], DOCUMENT, None),
                                             (prompted, TEXTS[:1], QUERY, "search")):
        assert {name: array.shape[1] for name, array in answer.tensors.items() if name in NAMES} == dict.fromkeys(
            NAMES, width)
        assert_rows_match(answer.tensors, reference_rows(model, texts, side_name, prompt), pad_id)
    # usage counts the text's tokens: a query's expansion is the model's padding, not the text's
    np.testing.assert_array_equal(query.tensors[TOKEN_COUNT_OUTPUT][:, 0],
                                  [len(served.side_tokenizers[QUERY].encode(PROMPTS["query"] + t).ids)
                                   for t in TEXTS[:2]])


def test_a_query_needs_its_expansions_width(tokenizer_model):
    served, _, sides = tokenizer_model
    (short,) = served.execute([TextRequest(["cat"], **{INPUT_TYPE_PARAMETER: QUERY})])
    assert short.tensors["input_ids"].shape[1] == sides.query.expansion.length == 12
    assert short.tensors[SCORE_MASK].sum() == 12
    assert short.tensors["attention_mask"].sum() == 4  # [CLS] [unused0] cat [SEP]: the encoder skips the expansion


@pytest.mark.parametrize("side_name", [QUERY, DOCUMENT])
def test_tokenize_shows_a_sides_text_with_its_marker_untruncated(tokenizer_model, side_name):
    served, *_ = tokenizer_model
    (answer,) = served.execute([TextRequest(TEXTS[-1:], outputs=[TOKENS_OUTPUT], **{INPUT_TYPE_PARAMETER: side_name})])
    tokens = json.loads(answer.tensors[TOKENS_OUTPUT][0, 0])
    assert tokens["text"][1] == PROMPTS[side_name].strip()
    assert len(tokens["ids"]) > served.sides.side(side_name).max_length


def test_the_tokenizer_step_reads_the_sides_clients_name():
    """The sides the tokenizer step reads (its copy in the repository imports nothing of nexus-sli) are the
    ones clients send and ensembles list."""
    assert (QUERY, DOCUMENT) == SIDE_NAMES == (multi_vector.QUERY, multi_vector.DOCUMENT)
    assert multi_vector.INPUT_TYPES.split(",") == list(SIDE_NAMES)

