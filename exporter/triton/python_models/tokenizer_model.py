"""Triton python model: raw strings -> the encoder's token tensors.

Its parameters are ``model_parameters.TokenizerParameters``.  Modes (the ``mode`` parameter):
- ``single``: ``TEXT`` (one string per batch item); dynamically batched.
- ``pair``: ``QUERY`` (one string) and ``DOCUMENTS`` (N strings) -> N (query, document) rows.
- ``qa``: ``QUESTION`` and ``CONTEXT`` -> one row per overlapping window of the context; besides the
  graph's inputs, each token's ``offsets``, ``context_mask`` and, in repositories exported since answers
  cover whole words, ``word_spans`` (its word's characters, ``encoding.to_arrays``).
- ``sided``: ``TEXT``, as ``single``, for a late-interaction model: the request parameter
  ``input_type`` (``error_codes.INPUT_TYPE_PARAMETER``: ``query`` or ``document``, absent:
  ``document``) picks the side (the ``sides`` parameter, ``sides.Sides``) whose prompt, truncation,
  expansion and scoring mask (``score_mask``, where the config declares it) the request gets.

Every row is padded to the smallest of the ``pad_widths`` its batch fits in
(``max_length`` for the rare longer row), so the encoder's dynamic batcher can
merge requests: Triton batches only equal shapes.  CPU repositories have one
width up to 512 tokens, then doublings, and the encoder cuts the padding off
again; GPU repositories have buckets (:func:`encoding.padded_length`).

An embedding or rerank model's named prompts (``prompts``, ``default_prompt_name``
parameters, from its sentence-transformers config) are applied here, as
sentence-transformers applies them: the prompt of the request parameter
``prompt_name`` (else the default prompt, if the model has one) is put in
front of each text (mode ``pair``: the query) before tokenising, so truncation counts it and every
client, whatever it sends through, gets the model's prompt.  In mode ``sided`` the
side's prompt (its marker) takes the default prompt's place, and a ``prompt_name``
replaces it, as in sentence-transformers' ``encode_query(prompt_name=...)``.

A ``single``- or ``sided``-mode tokenizer answers two more kinds of request, for the gateway's
``/tokenize`` and ``/decode`` (every export before them lacks these, and
answers Triton's own error about the unknown tensor):
- ``TEXT`` with the output ``TOKENS`` asked for by name (and none of the
  encoder's tensors): each text's tokens,
  prompted as above and untruncated, as one JSON object (``error_codes.TOKENS_OUTPUT``),
  the special tokens added unless the request parameter ``add_special_tokens`` is false;
- ``IDS`` instead of ``TEXT``: each row's text, ``DECODED``, the special tokens
  left out unless ``skip_special_tokens`` is false.
The tokenizer is the one the model uses (its tokenizer.json), without the
truncation, which only the encoder's input needs; in mode ``sided`` the prompt is
the request's side's (``input_type``), and a query's expansion, which is no part
of its text, is not shown.

Where its config declares ``TOKEN_COUNT`` (``error_codes.TOKEN_COUNT_OUTPUT``:
an embedding model's tokenizer, for OpenAI's ``usage``), every request for the
encoder's tensors also gets each row's token count, the tokens the encoder
reads (prompt and special tokens included, after truncation; a query's expansion
is not counted: OpenAI-style usage counts the text's tokens, not the padding a
model scores), so the ensemble
answers the vectors and their count in one call.

Every request gets its own answer: a request that cannot be tokenized gets an
error naming the input, the item and the reason, and the other requests of the
same execution are unaffected.
"""

import json
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils
from encoding import (
    TOKENIZER_MODES,
    TextTooLongError,
    check_lengths,
    cut_characters,
    encode_cut,
    load_tokenizer,
    padded_length,
    to_arrays,
    windows,
)
from error_codes import (
    ADD_SPECIAL_TOKENS_PARAMETER,
    DECODED_OUTPUT,
    IDS_INPUT,
    INPUT_TYPE_PARAMETER,
    INVALID_INPUT,
    NO_TOKEN,
    PROMPT_PARAMETER,
    SKIP_SPECIAL_TOKENS_PARAMETER,
    TOKEN_COUNT_OUTPUT,
    TOKENS_OUTPUT,
    mark,
)
from model_parameters import SIDES, TokenizerParameters, strings
from sides import DOCUMENT, SIDE_NAMES, Sides, row_width, side_tokenizers, sided_arrays

#: The outputs of the text modes, computed only for the requests that ask for them.
TEXT_OUTPUTS = (TOKENS_OUTPUT, DECODED_OUTPUT)
#: Token arrays read from a full encoding (offsets, sequence and word ids, special tokens), which
#: ``encode_batch_fast`` may leave out: NER's and QA's (``encoding.to_arrays``).
SPAN_ARRAYS = ("offsets", "context_mask", "word_spans", "special_tokens_mask")


def _strings(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        raise ValueError(f"input {name} is missing")
    texts = []
    for index, item in enumerate(tensor.as_numpy().reshape(-1)):
        try:
            texts.append(item.decode("utf-8") if isinstance(item, bytes) else str(item))
        except UnicodeDecodeError as exc:
            raise ValueError(f"{name} item {index} is not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
    return texts


def _parameter(request, name, default=None):
    return json.loads(request.parameters() or "{}").get(name, default)


def _flag(request, name, default):
    value = _parameter(request, name, default)
    if not isinstance(value, bool):
        # a request's mistake: answered as invalid input, as every ValueError here is
        raise ValueError(f"request parameter {name} must be true or false, got {value!r}")  # noqa: TRY004
    return value


def _described(encoding, text):
    """One text's tokens as ``TOKENS`` answers them: the characters each covers (``offsets``) and the same span
    in UTF-8 bytes (``bytes``: TEI's offsets, which its Rust tokenizer counts in bytes), a special token its own
    string and the span [0, 0]."""
    special = [bool(flag) for flag in encoding.special_tokens_mask]
    offsets = [[0, 0] if flag else [int(start), int(stop)] for flag, (start, stop) in zip(special, encoding.offsets)]
    pieces = [token if flag else text[start:stop]
              for token, flag, (start, stop) in zip(encoding.tokens, special, offsets)]
    byte_at = np.cumsum([0, *(len(c.encode("utf-8")) for c in text)])  # character index -> byte index
    spans = [[int(byte_at[start]), int(byte_at[stop])] for start, stop in offsets]
    return {"ids": list(encoding.ids), "text": pieces, "special": special, "offsets": offsets, "bytes": spans}


def _strings_out(values):
    return np.array([[value.encode("utf-8")] for value in values], dtype=object)


def _guarded(step, request):
    """(step(request), None), or (None, the error message for this request alone)."""
    try:
        return step(request), None
    except (ValueError, TextTooLongError) as exc:
        return None, mark(INVALID_INPUT, str(exc))
    except BaseException as exc:  # noqa: BLE001 - tokenizers' Rust panics are BaseExceptions
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        return None, mark(INVALID_INPUT, f"the input could not be tokenized: {type(exc).__name__}: {exc}")


def _answer(tensors, error):
    if error is not None:
        return pb_utils.InferenceResponse(error=pb_utils.TritonError(error))
    return pb_utils.InferenceResponse(output_tensors=tensors)


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = TokenizerParameters.read(strings(config))
        here = Path(args["model_repository"]) / args["model_version"]
        self.mode = params.mode
        if self.mode not in TOKENIZER_MODES:
            raise ValueError(f"unknown tokenizer mode {self.mode!r}; known modes: {', '.join(TOKENIZER_MODES)}")
        self.max_length, self.truncate, self.pad_id = params.max_length, params.truncate, params.pad_id
        self.pad_widths = list(params.widths)
        self.stride = params.stride
        # Rows one request may become (pair and qa modes): the encoder's max_batch_size.
        self.max_rows = params.max_rows
        strategy = "only_second" if self.mode == "qa" else "longest_first"
        path = str(here / "tokenizer.json")
        self.tokenizer = load_tokenizer(path, self.max_length, self.truncate or self.mode == "qa", self.stride,
                                        strategy)
        # the question's tokens (qa), and /tokenize's, are counted however many there are
        self.untruncated = load_tokenizer(path, self.max_length, truncate=False)
        declared = [output["name"] for output in config["output"]]
        self.output_names = [name for name in declared if name not in (*TEXT_OUTPUTS, TOKEN_COUNT_OUTPUT)]
        self.counts = TOKEN_COUNT_OUTPUT in declared
        # Rows that need no character offsets (every output but NER's and QA's) are tokenized without them:
        # the same ids, less work (bench/data/tried.md, "The tokenizer step's own work"); tokenizers before
        # 0.20 have no encode_batch_fast
        self.rows_only = not set(SPAN_ARRAYS) & set(self.output_names)
        # a long text tokenized only as far as truncation keeps, cut where that is exact (encoding.encode_cut)
        self.cut_before = cut_characters(self.tokenizer) if self.truncate else ""
        self.prompts = params.prompts.named
        self.default_prompt = params.prompts.default
        if self.mode == "sided":
            self._sided(params, path)

    def _sided(self, params, path):
        """The two sides and a tokenizer truncating at each one's length."""
        if params.sides is None:
            raise ValueError(f"a sided tokenizer's config has no parameter {SIDES.key!r}")
        self.sides = Sides.from_json(params.sides)
        widest = max(row_width(self.sides.side(name).max_length, self.sides.side(name)) for name in SIDE_NAMES)
        if widest > self.max_length:  # padded_length falls back to max_length: every row must fit in it
            raise ValueError(f"max_length {self.max_length} is narrower than a side's rows ({widest} tokens)")
        self.side_tokenizers = side_tokenizers(path, self.sides, self.truncate)

    def _side(self, request):
        """The side (``sides.SIDE_NAMES``) the request's texts are encoded for."""
        name = _parameter(request, INPUT_TYPE_PARAMETER, DOCUMENT)
        self.sides.side(name)  # an unknown side is this request's error, naming the known ones
        return name

    def _default_prompt(self, request):
        if self.mode == "sided":
            return self.sides.side(self._side(request)).prompt
        return self.prompts[self.default_prompt] if self.default_prompt else ""

    def _prompt(self, request):
        """The text put in front of each of the request's texts: its named prompt, else the default."""
        name = _parameter(request, PROMPT_PARAMETER)
        if name is None:
            return self._default_prompt(request)
        if name not in self.prompts:
            known = ", ".join(repr(n) for n in self.prompts) if self.prompts else "none (this model has no prompts)"
            raise ValueError(f"unknown {PROMPT_PARAMETER} {name!r}; this model's prompts: {known}")
        return self.prompts[name]

    def _too_many(self, rows):
        return self.max_rows is not None and rows > self.max_rows

    def _qa(self, request):
        question, context = _strings(request, "QUESTION"), _strings(request, "CONTEXT")
        if len(question) != 1 or len(context) != 1:
            raise ValueError("send exactly one QUESTION and one CONTEXT per request")
        if not context[0].strip():
            raise ValueError("CONTEXT is empty: there is nothing to find an answer in")
        # A window holds the question, the special tokens and more than `stride` context tokens.
        room = self.max_length - self.tokenizer.num_special_tokens_to_add(True) - self.stride - 1
        length = len(self.untruncated.encode(question[0], add_special_tokens=False).ids)
        if length > room:
            raise ValueError(f"QUESTION has {length} tokens; the model takes {self.max_length} per window, "
                             f"so a question may have at most {room}")
        found = windows(self.tokenizer, question[0], context[0])
        if self._too_many(len(found)):
            chars = len(context[0]) * self.max_rows // len(found)
            raise ValueError(f"CONTEXT is too long: it needs {len(found)} windows of {self.max_length} tokens and one "
                             f"request takes at most {self.max_rows}; split it into parts of about {chars} characters")
        return found

    def _encodings(self, request):
        """A ``pair`` or ``qa`` request's encodings."""
        prompt = self._prompt(request)  # where the model has no prompts, a prompt_name is an error, not ignored
        if self.mode == "qa":
            return self._qa(request)
        query, documents = _strings(request, "QUERY"), _strings(request, "DOCUMENTS")
        if len(query) != 1:
            raise ValueError("send exactly one QUERY per request")
        query = [prompt + query[0]]  # a cross-encoder's prompt: in front of the query, as CrossEncoder.predict puts it
        if not documents:
            raise ValueError("DOCUMENTS is empty: nothing to rerank")
        if self._too_many(len(documents)):
            raise ValueError(f"DOCUMENTS has {len(documents)} items and one request takes at most "
                             f"{self.max_rows}; send them in several requests (the client does)")
        if self.cut_before:  # long documents tokenized only as far as truncation keeps, where that is exact
            first = (query[0], len(self.untruncated.encode(query[0], add_special_tokens=False).ids))
            encodings = encode_cut(self.tokenizer.encode_batch, documents, self.max_length, first, self.cut_before)
        else:
            encodings = self.tokenizer.encode_batch([(query[0], d) for d in documents])
        if not self.truncate:
            check_lengths(encodings, self.max_length)
        return encodings

    def _texts(self, request):
        """A ``single`` or ``sided`` request's texts as its rows encode them (each with its prompt), and the side
        they are encoded for (None but in mode ``sided``)."""
        side = self._side(request) if self.mode == "sided" else None
        prompt = self._prompt(request)
        return [prompt + text for text in _strings(request, "TEXT")], side

    def _rows(self, requests):
        """Each request's (encodings, side), or its error.  The requests of several texts are tokenized in one
        call per side: a call's own cost is a large part of a short request's.  A request of one text is
        tokenized alone, on this thread: a call of several texts goes to tokenizers' thread pool, which one
        text does not pay for (bench/data/tried.md, "The tokenizer step's own work")."""
        rows, errors, texts = {}, {}, {}
        single = self.mode in ("single", "sided")
        for number, request in requests.items():
            found, error = _guarded(self._texts if single else lambda r: (self._encodings(r), None), request)
            if error is not None:
                errors[number] = error
            else:
                (texts if single else rows)[number] = found
        for side in {side for _, side in texts.values()}:
            numbers = [number for number, (_, of) in texts.items() if of == side]
            tokenizer, limit = ((self.tokenizer, self.max_length) if side is None else
                                (self.side_tokenizers[side], self.sides.side(side).max_length))
            several = {number for number in numbers if len(texts[number][0]) > 1}
            joined, _ = (_guarded(lambda t: self._encode(tokenizer, t, limit),
                                  [t for n in numbers if n in several for t in texts[n][0]]) if several else ([], None))
            start = 0
            for number in numbers:
                own = texts[number][0]
                if number in several and joined is not None:
                    mine, error = joined[start:start + len(own)], None
                    start += len(own)
                else:  # one text, or the one call failed: each request's texts alone say which one fails
                    mine, error = _guarded(lambda t: self._encode(tokenizer, t, limit), own)
                if error is None and not self.truncate:
                    _, error = _guarded(lambda e: check_lengths(e, limit), mine)
                if error is None:
                    rows[number] = (mine, side)
                else:
                    errors[number] = error
        return rows, errors

    def _width(self, encoding, side):
        """The width a row needs: its tokens, or on a side with an expansion, at least the expansion's."""
        return len(encoding.ids) if side is None else row_width(len(encoding.ids), self.sides.side(side))

    def _encode(self, tokenizer, texts, limit):
        """``texts``' encodings for the encoder's rows (truncated at ``limit`` tokens): without character offsets
        where no output needs them, and a long text's only as far as truncation keeps where that is exact."""
        fast = getattr(tokenizer, "encode_batch_fast", None) if self.rows_only else None
        encode = fast or tokenizer.encode_batch
        return encode_cut(encode, texts, limit, characters=self.cut_before) if self.cut_before else encode(texts)

    def _tokens(self, request):
        prompt = self._prompt(request)
        texts = [prompt + text for text in _strings(request, "TEXT")]
        add = _flag(request, ADD_SPECIAL_TOKENS_PARAMETER, True)
        encodings = self.untruncated.encode_batch(texts, add_special_tokens=add)
        return [pb_utils.Tensor(TOKENS_OUTPUT, _strings_out(json.dumps(_described(e, t), ensure_ascii=False)
                                                            for e, t in zip(encodings, texts)))]

    def _decoded(self, request):
        ids = pb_utils.get_input_tensor_by_name(request, IDS_INPUT).as_numpy()
        rows = [[int(i) for i in row if i != NO_TOKEN] for row in ids.reshape(ids.shape[0], -1)]
        size = self.untruncated.get_vocab_size(with_added_tokens=True)
        outside = sorted({i for row in rows for i in row if not 0 <= i < size})
        if outside:  # an error naming them, not a text silently shorter than asked
            raise ValueError(f"token ids {outside[:5]} are outside this model's vocabulary (0 to {size - 1})")
        texts = self.untruncated.decode_batch(rows, skip_special_tokens=_flag(request, SKIP_SPECIAL_TOKENS_PARAMETER,
                                                                               True))
        return [pb_utils.Tensor(DECODED_OUTPUT, _strings_out(texts))]

    def _text_step(self, request):
        """The text mode ``request`` asks for (None: the encoder's tensors)."""
        if pb_utils.get_input_tensor_by_name(request, IDS_INPUT) is not None:
            return self._decoded
        # a request that names no outputs is asked for all of them: it gets the encoder's tensors, as before
        asked = set(request.requested_output_names())
        return self._tokens if TOKENS_OUTPUT in asked and not asked & set(self.output_names) else None

    def execute(self, requests):
        answers = {}
        for number, request in enumerate(requests):
            step = self._text_step(request)
            if step is not None:
                answers[number] = _answer(*_guarded(step, request))
        answers.update(self._token_tensors({n: r for n, r in enumerate(requests) if n not in answers}))
        return [answers[number] for number in range(len(requests))]

    def _token_tensors(self, requests):
        """The encoder's token tensors for each request, all padded to one width."""
        encoded, errors = self._rows(requests)
        longest = max((self._width(e, side) for encs, side in encoded.values() for e in encs), default=1)
        length = padded_length(longest, self.pad_widths, self.max_length)
        answers = {number: _answer(None, error) for number, error in errors.items()}
        for number, (encodings, side) in encoded.items():  # a request whose arrays fail fails alone
            answers[number] = _answer(*_guarded(lambda _: self._tensors(encodings, side, length), None))
        return answers

    def _tensors(self, encodings, side, length):
        """One request's encoder tensors, padded to ``length``, and where this step counts, each row's tokens
        (its real tokens: a query's expansion is the model's, not the text's)."""
        if side is None:
            arrays = to_arrays(encodings, self.output_names, self.pad_id, length)
        else:
            arrays = sided_arrays(encodings, side, self.sides, self.output_names, self.pad_id, length)
        tensors = [pb_utils.Tensor(name, arrays[name].astype(np.int64, copy=False)) for name in self.output_names]
        if self.counts:
            counts = np.array([len(e.ids) for e in encodings], dtype=np.int64).reshape(-1, 1)
            tensors.append(pb_utils.Tensor(TOKEN_COUNT_OUTPUT, counts))
        return tensors
