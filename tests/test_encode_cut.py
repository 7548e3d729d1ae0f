"""A long text tokenized only as far as truncation keeps (``encoding.encode_cut``): for every kind of tokenizer
that ``cut_characters`` admits, the same encodings as tokenizing the whole text (ids, types, offsets, special
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
from nexus_sli.exporter.triton.python_models.encoding import CUT_BEFORE, CUT_CHARS_PER_TOKEN, cut_characters, encode_cut

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
#: Characters a cut meets: words, runs of spaces, tabs and newlines, punctuation, digits, CJK (no spaces between
#: words), combining accents, a control character, an emoji, a no-break space, other whitespace (cut before:
#: \r, \u3000, \u2028; not: \x0b, \x85, \x1c, which some tokenizers drop or keep in words)
ALPHABET = ("abcdefghij ABC     \t\n.,;:'!?0123456789中文字符éü\u0301\x00😀\u00a0-_"
            "\r\u3000\u2028\x0b\x85\x1c")


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
    # Nmt and NFKC: sentencepiece's nmt_nfkc, which makes a space of every whitespace the text is cut before
    # (NFKC alone keeps newlines in words: test_a_metaspace_that_keeps_newlines_is_cut_at_spaces_only)
    tokenizer.normalizer = normalizers.Sequence([normalizers.Nmt(), normalizers.NFKC(), normalizers.Replace("``", '"'),
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
    assert cut_characters(built), request.param
    return built


def _cut_and_seen(tokenizer, text: str, max_length: int) -> tuple[list, list[int]]:
    """``text`` through :func:`encode_cut` with ``tokenizer``'s cut characters: its encodings, and the length of
    each text the tokenizer was given."""
    seen: list[int] = []

    def encode(texts):
        seen.extend(map(len, texts))
        return tokenizer.encode_batch(texts)

    return encode_cut(encode, [text], max_length, characters=cut_characters(tokenizer)), seen


def _described(encodings) -> list[tuple]:
    return [(e.ids, e.type_ids, e.offsets, e.special_tokens_mask, e.word_ids, e.attention_mask, bool(e.overflowing))
            for e in encodings]


#: Pieces of the texts drawn: short runs of the alphabet, spaces alone and in runs, and long words (one token
#: or few for hundreds of characters: a first cut that holds too few tokens, so cut again)
PIECES = st.one_of(st.text(ALPHABET, max_size=12),
                   st.sampled_from([" ", "  ", " \t ", "\n ", " <mark> ", "\n", "\t", "\r\n", "\u3000", "\n<mark>\n"]),
                   st.text("xy", min_size=90, max_size=400))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(texts=st.lists(st.lists(PIECES, max_size=60).map("".join), min_size=1, max_size=4),
       max_length=st.integers(4, 40))
def test_a_cut_text_encodes_as_the_whole_text(tokenizer, texts, max_length):
    tokenizer.enable_truncation(max_length)
    cut = encode_cut(tokenizer.encode_batch, texts, max_length, characters=cut_characters(tokenizer))
    assert _described(cut) == _described(tokenizer.encode_batch(texts))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(query=st.lists(PIECES, max_size=8).map("".join),
       documents=st.lists(st.lists(PIECES, max_size=20).map("".join), min_size=1, max_size=3),
       max_length=st.integers(10, 40))  # the reference's overflow windows: thousands below that
def test_a_cut_document_encodes_with_its_query_as_the_whole_document(tokenizer, query, documents, max_length):
    """Rerank pairs, truncated longest first: queries from none to more tokens than the model takes, so that
    either side may be the shorter, or both be cut."""
    tokenizer.enable_truncation(max_length)
    first = (query, len(tokenizer.encode(query, add_special_tokens=False).ids))
    assert _described(encode_cut(tokenizer.encode_batch, documents, max_length, first,
                                     cut_characters(tokenizer))) == _described(
        tokenizer.encode_batch([(query, document) for document in documents]))


def test_a_long_text_is_tokenized_only_as_far_as_truncation_keeps(tokenizer):
    """A text of words far past the model's length is tokenized from its first few hundred characters; one whose
    first cut holds too few tokens (a long word without spaces) is cut again, longer, and still encodes whole."""
    max_length = 32
    tokenizer.enable_truncation(max_length)
    prose = " ".join(validation_texts())  # about 30,000 characters
    unbroken = "x" * (3 * CUT_CHARS_PER_TOKEN * max_length) + " " + prose  # its first space past the first cut
    for text in (prose, unbroken):
        cut, seen = _cut_and_seen(tokenizer, text, max_length)
        assert _described(cut) == _described(tokenizer.encode_batch([text]))
        assert seen and max(seen) < len(text) / 20, seen
    assert seen[0] == 3 * CUT_CHARS_PER_TOKEN * max_length  # up to the first space, not the whole text


@pytest.mark.parametrize("change, why", [
    (lambda t: setattr(t, "pre_tokenizer", pre_tokenizers.Split(" ", "isolated")), "a pattern of its own"),
    (lambda t: setattr(t, "pre_tokenizer", pre_tokenizers.Metaspace(split=False)), "one piece for the text"),
    (lambda t: setattr(t, "pre_tokenizer", pre_tokenizers.ByteLevel(use_regex=False)), "no split"),
    (lambda t: setattr(t, "pre_tokenizer", None), "no pre-tokenizer"),
    (lambda t: setattr(t, "normalizer", normalizers.Replace("a b", "ab")), "a replacement across a space"),
    (lambda t: setattr(t, "normalizer", normalizers.Replace("a\nb", "ab")), "a replacement across a newline"),
    (lambda t: t.add_tokens(["new york"]), "an added token across a space"),
    (lambda t: t.add_tokens(["new\tyork"]), "an added token across a tab, a space once normalized"),
], ids=lambda value: value if isinstance(value, str) else "")
def test_a_tokenizer_whose_words_may_join_across_a_space_is_never_cut(change, why):
    tokenizer = _packaged()
    change(tokenizer)
    assert cut_characters(tokenizer) == "", why


#: Words apart by whitespace other than spaces: newlines, tabs, and mixed (with \x0b and \x85, not cut before)
SEPARATED = {"newline": ["\n"], "tab": ["\t"], "crlf": ["\r\n", "\n\n"],
             "mixed": ["\n", "\t", "\r\n", "\u3000", "\xa0", "\u2028", "\u2003", " \t\n", "\x0b\n", "\x85\t"]}


def _separated(separators: list[str]) -> str:
    """The validation texts' words (about 70,000 characters) apart by ``separators`` in turn, no space but theirs."""
    words = " ".join(validation_texts()).split()
    return "".join(word + separators[number % len(separators)] for number, word in enumerate(words))


@pytest.mark.parametrize("separated", sorted(SEPARATED))
def test_a_long_text_of_other_whitespace_is_cut_and_encodes_as_the_whole_text(tokenizer, separated):
    """Cut before the newline, tab or other whitespace (:data:`CUT_BEFORE`) past the first cut, alone and as a
    pair's second text: the same ids, offsets and overflow as the whole text, from its first characters."""
    text, max_length = _separated(SEPARATED[separated]), 32
    assert " " not in text or separated == "mixed"
    tokenizer.enable_truncation(max_length)
    query = "the weather"  # the shorter side, untruncated: else the whole document is tokenized
    first = (query, len(tokenizer.encode(query, add_special_tokens=False).ids))
    seen: list[int] = []

    def encode(texts):
        seen.extend(len(t if isinstance(t, str) else t[1]) for t in texts)
        return tokenizer.encode_batch(texts)

    characters = cut_characters(tokenizer)
    assert _described(encode_cut(encode, [text, text[:3000]], max_length, characters=characters)) == _described(
        tokenizer.encode_batch([text, text[:3000]]))
    assert _described(encode_cut(encode, [text], max_length, first, characters)) == _described(
        tokenizer.encode_batch([(query, text)]))
    if any(character in characters for character in "".join(SEPARATED[separated])):
        assert max(seen) <= CUT_CHARS_PER_TOKEN * max_length < len(text) / 200, seen
    else:  # a separator that does not end this tokenizer's words (a Metaspace's newline): the whole text
        assert max(seen) == len(text), seen


def test_a_newline_separated_text_is_tokenized_only_from_its_start():
    """Lines without spaces (a list, a log, a table) are cut at a newline, not tokenized whole."""
    tokenizer = _packaged()
    tokenizer.enable_truncation(128)
    text = _separated(["\n"])
    cut, seen = _cut_and_seen(tokenizer, text, 128)
    assert _described(cut) == _described(tokenizer.encode_batch([text]))
    assert seen == [len(text[:CUT_CHARS_PER_TOKEN * 128 + 1].rsplit("\n", 1)[0])], seen


def test_every_cut_character_ends_a_word_as_a_space_does(tokenizer):
    """Each of :data:`CUT_BEFORE` between two words, at a cut: the first word's tokens and offsets are the same
    as with a space there, and as with nothing after it."""
    tokenizer.no_truncation()
    for character in cut_characters(tokenizer):
        for word in ("weather", "it's", "(1987)", "naïve"):
            whole = tokenizer.encode(f"the {word}{character}tomorrow", add_special_tokens=False)
            cut = tokenizer.encode(f"the {word}", add_special_tokens=False)
            assert (whole.ids[:len(cut.ids)], whole.offsets[:len(cut.offsets)]) == (cut.ids, cut.offsets), (
                hex(ord(character)), word)


def test_a_text_without_whitespace_is_tokenized_whole(tokenizer):
    """CJK without spaces, or one long word, is not cut: within a run of letters a cut changes the tokens (a
    byte-level BPE, a unigram or word-piece vocabulary joins characters across it), so truncation keeps the
    whole text's."""
    tokenizer.enable_truncation(16)
    for text in ("中文字符" * 500, "x" * 2000, "中文。字符，" * 400):
        cut, seen = _cut_and_seen(tokenizer, text, 16)
        assert _described(cut) == _described(tokenizer.encode_batch([text]))
        assert seen[-1] == len(text)


def test_a_metaspace_that_keeps_newlines_is_cut_at_spaces_only():
    """A Metaspace whose normalizer keeps newlines joins a word across one: the word's pieces before it differ
    with and without what follows it, so such a text is cut at spaces only."""
    vocab = [("[UNK]", 0.0), ("▁x", -1.0), ("yz", -1.0), ("▁xy", -1.0), ("z\n", -1.0), ("z", -5.0), ("q", -5.0)]
    tokenizer = Tokenizer(models.Unigram(vocab, unk_id=0))
    tokenizer.normalizer, tokenizer.pre_tokenizer = normalizers.NFKC(), pre_tokenizers.Metaspace()
    assert tokenizer.encode("xyz").tokens == ["▁x", "yz"]
    assert tokenizer.encode("xyz\nq").tokens[:2] == ["▁xy", "z\n"]
    assert "\n" not in cut_characters(tokenizer) and " " in cut_characters(tokenizer)
    tokenizer.enable_truncation(4)
    text = "xyz\nq " * 2000
    assert _described(encode_cut(tokenizer.encode_batch, [text], 4, characters=" ")) == _described(
        tokenizer.encode_batch([text]))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Nmt(), normalizers.NFKC()])  # sentencepiece's
    assert tokenizer.encode("xyz\nq").tokens[:2] == ["▁x", "yz"] and "\n" in cut_characters(tokenizer)


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
    assert loaded.cut_before == CUT_BEFORE
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
    assert loaded.mode == "pair" and loaded.cut_before == CUT_BEFORE
    prose = " ".join(validation_texts())
    query, documents = "what does the text say about the weather", [prose, "a short document", prose[:5000]]
    (answer,) = loaded.execute([_PairRequest(query, documents)])
    reference = loaded.tokenizer._tokenizer.encode_batch([(query, d) for d in documents])  # whole, truncated
    for row, encoding in enumerate(reference):
        assert answer.tensors["input_ids"][row, :len(encoding.ids)].tolist() == encoding.ids
        assert answer.tensors["token_type_ids"][row, :len(encoding.ids)].tolist() == encoding.type_ids
        assert answer.tensors["attention_mask"][row].sum() == len(encoding.ids)
    assert max(seen) <= CUT_CHARS_PER_TOKEN * loaded.max_length < len(prose)
