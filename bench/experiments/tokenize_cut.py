"""Long texts through the joined model with and without the tokenizer step's cut (``encoding.encode_cut``).

An experiment, not part of the product or of ``make bench`` (no test runs it); its findings are in
bench/data/tried.md, "Long texts tokenized only as far as truncation keeps".  One request of ``--texts``
texts of each length (the bench's validation texts joined, then cut to that many characters) through the
joined model's ``execute`` in this process (``bench/joined_profile.py``'s stand-in for the python backend),
the tokenizer step's cut on and off in turn, the order swapped from one repetition to the next::

    .venv/bin/nexus-sli export --backend onnxruntime --precision fp32 --no-search --out /tmp/cutrepo
    .venv/bin/python bench/experiments/tokenize_cut.py /tmp/cutrepo all_minilm_l6_v2

It prints, per length, the medians of the whole execution and of the tokenizer step, cut and whole.
``--pairs``: a rerank request's tokenizing instead, a short query with each text (the tokenizer step's
calls in mode ``pair``, with the model's tokenizer and length), cut and whole.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

from nexus_sli.bench.joined_profile import JoinedModel, TextRequest
from nexus_sli.exporter.export.validate import validation_texts
from nexus_sli.exporter.triton.python_models.encoding import encode_cut, load_tokenizer

QUERY = "what does the text say about the weather"


def _document(chars: int, rng: random.Random) -> str:
    texts, taken = [], 0
    while taken < chars:
        texts.append(rng.choice(validation_texts()))
        taken += len(texts[-1]) + 1
    return " ".join(texts)[:chars]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("repository", type=Path)
    parser.add_argument("model")
    parser.add_argument("--texts", type=int, default=32)
    parser.add_argument("--repetitions", type=int, default=7)
    parser.add_argument("--lengths", type=int, nargs="+", default=[100, 2000, 20000, 100000])
    parser.add_argument("--pairs", action="store_true", help="a rerank request's tokenizing (query, text)")
    args = parser.parse_args()
    if args.pairs:
        return pairs(args)
    joined = JoinedModel(args.repository, args.model)
    tokenizer_step, tokenizer_times = joined.model.steps[0].model, next(iter(joined.times.values()))
    print(f"tokenizer step cuts: {tokenizer_step.cut}; max_length {tokenizer_step.max_length}")
    rng = random.Random(0)
    for chars in args.lengths:
        request = [TextRequest([_document(chars, rng) for _ in range(args.texts)])]
        joined.model.execute(request)  # warm
        whole: dict[bool, list[float]] = {True: [], False: []}
        step: dict[bool, list[float]] = {True: [], False: []}
        for repetition in range(args.repetitions):
            for cut in (True, False) if repetition % 2 else (False, True):
                tokenizer_step.cut = cut
                began = time.perf_counter()
                (answer,) = joined.model.execute(request)
                whole[cut].append((time.perf_counter() - began) * 1e3)
                step[cut].append(tokenizer_times[-1])
                assert not answer.has_error(), answer.error()
        cut_ms, whole_ms = statistics.median(whole[True]), statistics.median(whole[False])
        print(f"{chars:>7} chars x {args.texts}: execute cut {cut_ms:8.1f} ms, whole {whole_ms:8.1f} ms "
              f"({whole_ms / cut_ms:5.2f}x); tokenizer step cut {statistics.median(step[True]):7.1f} ms, "
              f"whole {statistics.median(step[False]):7.1f} ms")


def pairs(args) -> None:
    joined = JoinedModel(args.repository, args.model)
    step = joined.model.steps[0].model
    tokenizer = load_tokenizer(str(args.repository / f"{args.model}_tokenizer" / "1" / "tokenizer.json"),
                               step.max_length)
    first = (QUERY, len(tokenizer.encode(QUERY, add_special_tokens=False).ids))
    print(f"pairs with a query of {first[1]} tokens; max_length {step.max_length}")
    rng = random.Random(0)
    for chars in args.lengths:
        documents = [_document(chars, rng) for _ in range(args.texts)]
        ways = {True: lambda: encode_cut(tokenizer.encode_batch, documents, step.max_length, first),
                False: lambda: tokenizer.encode_batch([(QUERY, d) for d in documents])}
        assert [e.ids for e in ways[True]()] == [e.ids for e in ways[False]()]
        times: dict[bool, list[float]] = {True: [], False: []}
        for repetition in range(args.repetitions):
            for cut in (True, False) if repetition % 2 else (False, True):
                began = time.perf_counter()
                ways[cut]()
                times[cut].append((time.perf_counter() - began) * 1e3)
        cut_ms, whole_ms = statistics.median(times[True]), statistics.median(times[False])
        print(f"{chars:>7} chars x {args.texts}: pairs tokenized cut {cut_ms:8.1f} ms, whole {whole_ms:8.1f} ms "
              f"({whole_ms / cut_ms:5.2f}x)")


if __name__ == "__main__":
    main()
