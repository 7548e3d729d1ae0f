"""A long text tokenized only as far as truncation keeps (``encoding.encode_cut``): for every kind of tokenizer
that ``cuts_safely`` admits, the same encodings as tokenizing the whole text (ids, types, offsets, special
tokens, words), whatever the text; the kinds where a cut could change a word's tokens are refused; and the
tokenizer step, with it, answers a long text's rows as the whole text's while tokenizing only its start."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers, processors, trainers

from helpers.python_steps import load_step, unload
from nexus_sli.bench.joined_profile import Tensor, TextRequest
from nexus_sli.exporter.export.source import resolve_model
from nexus_sli.exporter.export.validate import validation_texts
from nexus_sli.exporter.serving.joined_steps import triton_json
from nexus_sli.exporter.triton import config as tc
from nexus_sli.exporter.triton.python_models.encoding import CUT_CHARS_PER_TOKEN, cuts_safely, encode_cut

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
#: Characters a cut meets: words, runs of spaces, tabs and newlines, punctuation, digits, CJK (no spaces between
#: words), combining accents, a control character, an emoji, a no-break space
ALPHABET = "abcdefghij ABC     \t\n.,;:'!?0123456789中文字符éü\u0301\x00😀\u00a0-_"


def _template(tokenizer: Tokenizer) -> Tokenizer:
    cls, sep = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    tokenizer.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
                                                             special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    return tokenizer


def _byte_level_bpe() -> Tokenizer:  # RoBERTa's and ModernBERT's kind
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tokenizer.train_from_iterator(validation_texts(), trainers.BpeTrainer(
        vocab_size=500, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return _template(tokenizer)


def _metaspace_unigram() -> Tokenizer:  # sentencepiece's kind (XLM-RoBERTa, DeBERTa v3), with its replacements
    tokenizer = Tokenizer(models.Unigram())
    tokenizer.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Replace("``", '"'),
                                                 normalizers.Lowercase()])
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.train_from_iterator(validation_texts(), trainers.UnigramTrainer(
        vocab_size=500, special_tokens=SPECIALS, unk_token="[UNK]"))
    return _template(tokenizer)


def _split_then_metaspace() -> Tokenizer:  # a sentencepiece tokenizer as transformers 5 saves XLM-RoBERTa's
    tokenizer = _metaspace_unigram()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Metaspace()])
    return tokenizer


def _word_level() -> Tokenizer:  # a sequence of pre-tokenizers: whitespace, then punctuation and digits apart
    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),
                                                       pre_tokenizers.Punctuation(), pre_tokenizers.Digits()])
    tokenizer.train_from_iterator(validation_texts(), trainers.WordLevelTrainer(vocab_size=500,
                                                                                special_tokens=SPECIALS))
    return _template(tokenizer)


def _packaged() -> Tokenizer:  # all-MiniLM-L6-v2's WordPiece: BertNormalizer, BertPreTokenizer
    tokenizer = Tokenizer.from_file(str(resolve_model(None).path / "tokenizer.json"))
    tokenizer.add_tokens([AddedToken("<mark>", lstrip=True, rstrip=True)])  # matched in the raw text, as added
    return tokenizer


TOKENIZERS = {"wordpiece": _packaged, "byte-level-bpe": _byte_level_bpe, "metaspace-unigram": _metaspace_unigram,
              "split-then-metaspace": _split_then_metaspace, "word-level": _word_level}


@pytest.fixture(scope="module", params=sorted(TOKENIZERS))
def tokenizer(request):
    built = TOKENIZERS[request.param]()
    built.no_padding()
    assert cuts_safely(built), request.param
    return built


def _described(encodings) -> list[tuple]:
    return [(e.ids, e.type_ids, e.offsets, e.special_tokens_mask, e.word_ids, e.attention_mask) for e in encodings]


#: Pieces of the texts drawn: short runs of the alphabet, spaces alone and in runs, and long words (one token
#: or few for hundreds of characters: a first cut that holds too few tokens, so cut again)
PIECES = st.one_of(st.text(ALPHABET, max_size=12), st.sampled_from([" ", "  ", " \t ", "\n ", " <mark> "]),
                   st.text("xy", min_size=90, max_size=400))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(texts=st.lists(st.lists(PIECES, max_size=60).map("".join), min_size=1, max_size=4),
       max_length=st.integers(4, 40))
def test_a_cut_text_encodes_as_the_whole_text(tokenizer, texts, max_length):
    tokenizer.enable_truncation(max_length)
    assert _described(encode_cut(tokenizer.encode_batch, texts, max_length)) == _described(
        tokenizer.encode_batch(texts))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(query=st.lists(PIECES, max_size=8).map("".join),
       documents=st.lists(st.lists(PIECES, max_size=20).map("".join), min_size=1, max_size=3),
       max_length=st.integers(10, 40))  # the reference's overflow windows: thousands below that
def test_a_cut_document_encodes_with_its_query_as_the_whole_document(tokenizer, query, documents, max_length):
    """Rerank pairs, truncated longest first: queries from none to more tokens than the model takes, so that
    either side may be the shorter, or both be cut."""
    tokenizer.enable_truncation(max_length)
    first = (query, len(tokenizer.encode(query, add_special_tokens=False).ids))
    assert _described(encode_cut(tokenizer.encode_batch, documents, max_length, first)) == _described(
        tokenizer.encode_batch([(query, document) for document in documents]))


def test_a_long_text_is_tokenized_only_as_far_as_truncation_keeps(tokenizer):
    """A text of words far past the model's length is tokenized from its first few hundred characters; one whose
    first cut holds too few tokens (a long word without spaces) is cut again, longer, and still encodes whole."""
    max_length = 32
    tokenizer.enable_truncation(max_length)
    prose = " ".join(validation_texts())  # about 30,000 characters
    unbroken = "x" * (3 * CUT_CHARS_PER_TOKEN * max_length) + " " + prose  # its first space past the first cut
    for text in (prose, unbroken):
        seen: list[int] = []

        def encode(texts):
            seen.extend(len(t) for t in texts)
            return tokenizer.encode_batch(texts)

        assert _described(encode_cut(encode, [text], max_length)) == _described(tokenizer.encode_batch([text]))
        assert seen and max(seen) < len(text) / 20, seen
    assert seen[0] == 3 * CUT_CHARS_PER_TOKEN * max_length  # up to the first space, not the whole text


@pytest.mark.parametrize("change, why", [
    (lambda t: setattr(t, "pre_tokenizer", pre_tokenizers.Split(" ", "isolated")), "a pattern of its own"),
    (lambda t: setattr(t, "pre_tokenizer", pre_tokenizers.Metaspace(split=False)), "one piece for the text"),
    (lambda t: setattr(t, "pre_tokenizer", pre_tokenizers.ByteLevel(use_regex=False)), "no split"),
    (lambda t: setattr(t, "pre_tokenizer", None), "no pre-tokenizer"),
    (lambda t: setattr(t, "normalizer", normalizers.Replace("a b", "ab")), "a replacement across a space"),
    (lambda t: t.add_tokens(["new york"]), "an added token across a space"),
    (lambda t: t.add_tokens(["new\tyork"]), "an added token across a tab, a space once normalized"),
], ids=lambda value: value if isinstance(value, str) else "")
def test_a_tokenizer_whose_words_may_join_across_a_space_is_never_cut(change, why):
    tokenizer = _packaged()
    change(tokenizer)
    assert not cuts_safely(tokenizer), why


@pytest.fixture
def step(exports, tmp_path, monkeypatch):
    """The packaged model's tokenizer step (truncating), its tokenizer calls' texts recorded."""
    folder = exports.copy("all_minilm_l6_v2", tmp_path, as_name="cut") / "cut_tokenizer"
    loaded = load_step(monkeypatch, folder / "1", "cut_tokenizer_model", triton_json(tc.read(folder / "config.pbtxt")),
                       folder)
    seen: list[int] = []
    monkeypatch.setattr(loaded, "tokenizer", _Recording(loaded.tokenizer, seen))
    yield loaded, seen
    unload()


class _Recording:
    """A tokenizer whose batch calls record their texts' lengths (``pairs``: their second texts')."""

    def __init__(self, tokenizer, seen: list, pairs: bool = False):
        self._tokenizer, self._seen, self._pairs = tokenizer, seen, pairs

    def __getattr__(self, name):
        found = getattr(self._tokenizer, name)
        if not name.startswith("encode_batch"):
            return found

        def recorded(texts, *args, **kwargs):
            self._seen.extend(len(text[1] if self._pairs else text) for text in texts)
            return found(texts, *args, **kwargs)
        return recorded


def test_the_tokenizer_step_answers_a_long_texts_rows_from_its_start(step):
    loaded, seen = step
    assert loaded.cut
    prose = " ".join(validation_texts())
    texts = [prose, "a short text", prose[:5000]]
    (answer,) = loaded.execute([TextRequest(texts)])
    reference = loaded.tokenizer._tokenizer.encode_batch(texts)  # the whole texts, truncated
    width = answer.tensors["input_ids"].shape[1]
    for row, encoding in enumerate(reference):
        assert answer.tensors["input_ids"][row, :len(encoding.ids)].tolist() == encoding.ids
        assert answer.tensors["attention_mask"][row].sum() == len(encoding.ids) <= width
    assert answer.tensors["TOKEN_COUNT"][:, 0].tolist() == [len(e.ids) for e in reference]
    assert max(seen) <= CUT_CHARS_PER_TOKEN * loaded.max_length < len(prose)


class _PairRequest(TextRequest):
    """A rerank request as the tokenizer step reads one: ``QUERY`` and ``DOCUMENTS``."""

    def __init__(self, query: str, documents: list[str]):
        super().__init__(documents)
        self._inputs = [Tensor("QUERY", np.array([[query.encode()]], dtype=object)),
                        Tensor("DOCUMENTS", np.array([[d.encode()] for d in documents], dtype=object))]


@pytest.fixture
def pair_step(exports, tmp_path, monkeypatch):
    """The packaged model's tokenizer step as a reranker's (mode ``pair``), its tokenizer calls recorded."""
    folder = exports.copy("all_minilm_l6_v2", tmp_path, as_name="cut") / "cut_tokenizer"
    config = triton_json(tc.read(folder / "config.pbtxt"))
    config["parameters"]["mode"] = {"string_value": "pair"}
    loaded = load_step(monkeypatch, folder / "1", "cut_tokenizer_model", config, folder)
    seen: list[int] = []
    monkeypatch.setattr(loaded, "tokenizer", _Recording(loaded.tokenizer, seen, pairs=True))
    yield loaded, seen
    unload()


def test_the_tokenizer_step_answers_long_documents_rows_from_their_start(pair_step):
    loaded, seen = pair_step
    assert loaded.mode == "pair" and loaded.cut
    prose = " ".join(validation_texts())
    query, documents = "what does the text say about the weather", [prose, "a short document", prose[:5000]]
    (answer,) = loaded.execute([_PairRequest(query, documents)])
    reference = loaded.tokenizer._tokenizer.encode_batch([(query, d) for d in documents])  # whole, truncated
    for row, encoding in enumerate(reference):
        assert answer.tensors["input_ids"][row, :len(encoding.ids)].tolist() == encoding.ids
        assert answer.tensors["token_type_ids"][row, :len(encoding.ids)].tolist() == encoding.type_ids
        assert answer.tensors["attention_mask"][row].sum() == len(encoding.ids)
    assert max(seen) <= CUT_CHARS_PER_TOKEN * loaded.max_length < len(prose)
