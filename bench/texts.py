"""The bench text set: project-written texts with a realistic length mix.

Built deterministically from the project's own text files, then stored as
``data/texts.txt`` (package data) so an installed package needs no test files:

- the 240 exporter validation texts (search queries, sentences, paragraphs,
  and ten long articles the model truncates at its limit);
- the 330 labelled topic sentences of ``tests/data/topics.tsv``;
- 35 short paragraphs: five consecutive sentences of one topic joined;
- 35 long documents: two consecutive validation paragraphs joined (about
  200-250 tokens, near MiniLM's 256-token limit).

``python -m nexus_sli.bench.texts`` rewrites the file from the sources; a test
checks that the stored file is what the sources give.
"""

from __future__ import annotations

import hashlib
import sys
from importlib import resources
from pathlib import Path

import numpy as np

TEXTS_FILE = "data/texts.txt"
TOPIC_PARAGRAPHS = 35
TOPIC_PARAGRAPH_SENTENCES = 5
LONG_DOCUMENTS = 35
#: validation texts with this many words or more (and below LONG_ARTICLE_WORDS) are paragraphs
PARAGRAPH_WORDS = 60
LONG_ARTICLE_WORDS = 300
#: token-length bins reported with the results
LENGTH_BINS = (0, 16, 32, 64, 128, 256, 512, 10**9)


def repository_root() -> Path:
    return Path(__file__).resolve().parent.parent


def read_topics(path: Path) -> list[tuple[str, str]]:
    rows = [line.split("\t", 1) for line in path.read_text("utf-8").splitlines() if line.strip()]
    return [(label, text) for label, text in rows]


def generate(validation: list[str], topics: list[tuple[str, str]]) -> list[str]:
    """The bench texts from their sources, in a fixed, length-mixed order."""
    by_label: dict[str, list[str]] = {}
    for label, text in topics:
        by_label.setdefault(label, []).append(text)
    groups = [sentences[i:i + TOPIC_PARAGRAPH_SENTENCES]
              for sentences in by_label.values()
              for i in range(0, len(sentences) - TOPIC_PARAGRAPH_SENTENCES + 1, TOPIC_PARAGRAPH_SENTENCES)]
    # Round-robin over the labels so every topic contributes paragraphs.
    per_label = len(groups) // len(by_label)
    interleaved = [groups[label * per_label + i] for i in range(per_label) for label in range(len(by_label))]
    topic_paragraphs = [" ".join(group) for group in interleaved[:TOPIC_PARAGRAPHS]]

    paragraphs = [t for t in validation if PARAGRAPH_WORDS <= len(t.split()) < LONG_ARTICLE_WORDS]
    long_documents = [f"{a} {b}" for a, b in zip(paragraphs[0::2], paragraphs[1::2])][:LONG_DOCUMENTS]

    texts = list(dict.fromkeys([*validation, *(text for _, text in topics), *topic_paragraphs, *long_documents]))
    # A content hash orders them: lengths come mixed, the same on every machine and Python.
    return sorted(texts, key=lambda t: hashlib.sha1(t.encode("utf-8")).hexdigest())


def generate_from_sources(root: Path | None = None) -> list[str]:
    from nexus_sli.exporter.export.validate import validation_texts

    root = root or repository_root()
    return generate(validation_texts(), read_topics(root / "tests" / "data" / "topics.tsv"))


def bench_texts() -> list[str]:
    """The stored bench text set (package data)."""
    text = resources.files("nexus_sli.bench").joinpath(TEXTS_FILE).read_text("utf-8")
    return [line for line in text.splitlines() if line.strip()]


def subset(texts: list[str], n: int) -> list[str]:
    """``n`` texts spread evenly over the set, so a subset keeps the length mix."""
    if n >= len(texts):
        return list(texts)
    return [texts[i] for i in np.linspace(0, len(texts) - 1, n).round().astype(int)]


def length_stats(lengths: list[int], max_length: int) -> dict:
    """Token counts of the texts (special tokens included), before and after truncation."""
    raw = np.asarray(lengths)
    served = np.minimum(raw, max_length)
    counts, _ = np.histogram(raw, bins=LENGTH_BINS)
    labels = [f"{lo}-{hi - 1}" if hi < 10**9 else f">={lo}" for lo, hi in zip(LENGTH_BINS, LENGTH_BINS[1:])]
    return {
        "texts": int(raw.size),
        "max_length": int(max_length),
        "tokens_mean": round(float(served.mean()), 1),
        "tokens_percentiles": {f"p{p}": int(np.percentile(served, p)) for p in (0, 10, 25, 50, 75, 90, 99, 100)},
        "histogram": {label: int(c) for label, c in zip(labels, counts)},
        "truncated": int((raw > max_length).sum()),
    }


def main() -> int:
    target = Path(__file__).resolve().parent / TEXTS_FILE
    texts = generate_from_sources()
    target.write_text("\n".join(texts) + "\n", encoding="utf-8")
    print(f"wrote {len(texts)} texts to {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())


def texts_of_length(tokenizer, source: list[str], n_tokens: int, count: int) -> list[str]:
    """``count`` different texts of ``n_tokens`` tokens each (special tokens included;
    never more, and exactly that where single-token filler words can make it up).

    Words are taken from ``source`` starting at a different place for each text;
    ``tokenizer`` must not truncate."""
    words = " ".join(source).split()

    def length(text: str) -> int:
        return len(tokenizer.encode(text).ids)

    texts = []
    for i in range(count):
        start = (i * 997) % len(words)
        stream = (words[start:] + words[:start])[:n_tokens]  # every word is at least one token
        low, high = 0, len(stream)
        while low < high:  # the most words that fit
            middle = (low + high + 1) // 2
            if length(" ".join(stream[:middle])) <= n_tokens:
                low = middle
            else:
                high = middle - 1
        text = " ".join(stream[:low])
        while length(f"{text} a") <= n_tokens and length(text) < n_tokens:
            text = f"{text} a"
        texts.append(text)
    return texts
