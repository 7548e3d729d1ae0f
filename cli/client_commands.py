"""``nexus-sli embed | classify | ner | answer | rerank``: one client call, JSON on stdout."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

#: command -> how it calls the client with the parsed arguments
CALLS = {
    "embed": lambda c, a: c.embed(a.texts, model=a.model, prompt_name=a.prompt_name, dimensions=a.dimensions).tolist(),
    "classify": lambda c, a: c.classify(a.texts, model=a.model, top_k=a.top_k),
    "ner": lambda c, a: c.ner(a.texts, model=a.model),
    "answer": lambda c, a: c.answer(a.question, a.context, model=a.model, top_k=a.top_k),
    "rerank": lambda c, a: c.rerank(a.query, a.documents, model=a.model, top_k=a.top_k),
}


def run(args: argparse.Namespace) -> int:
    from nexus_sli.client import ClientError, EncoderClient

    try:
        client = EncoderClient(args.url, protocol=args.protocol)
    except ValueError as exc:  # a malformed --url (an empty list, dns:/// without a port, ...), before any call
        print(f"nexus-sli: error: --url {args.url!r}: {exc}", file=sys.stderr)
        return 2
    try:
        with client:
            result = CALLS[args.command](client, args)
    except ClientError as exc:
        print(f"nexus-sli: error: {exc}", file=sys.stderr)
        return 3
    print(json.dumps(result, default=dataclasses.asdict))
    return 0


def _command(commands, name: str, help_text: str) -> argparse.ArgumentParser:
    sub = commands.add_parser(name, help=help_text)
    sub.add_argument("--model", required=True, help="model name in the repository")
    sub.add_argument("--url", default=None, type=_url,
                     help="server address, HOST:PORT (default 127.0.0.1:8001 gRPC / :8000 HTTP); several, "
                          "comma-separated, are replicas; dns:///NAME:PORT: every address of NAME")
    sub.add_argument("--protocol", default="grpc", choices=["grpc", "http"])
    sub.set_defaults(run=run)
    return sub


def _url(value: str) -> str:
    """``--url`` without a scheme: tritonclient takes HOST:PORT, and would fail on http://... with a traceback
    (HTTP) or an unreachable server (gRPC)."""
    from nexus_sli.client.replicas import DNS_PREFIX

    schemes = [u.strip() for u in value.split(",") if "://" in u and not u.strip().startswith(DNS_PREFIX)]
    if schemes:
        raise argparse.ArgumentTypeError(f"takes HOST:PORT without a scheme (or {DNS_PREFIX}NAME:PORT), "
                                         f"got {schemes[0]!r}")
    return value


def add_parsers(commands) -> None:
    embed = _command(commands, "embed", "embed texts")
    embed.add_argument("texts", nargs="+")
    embed.add_argument("--prompt-name", default=None,
                       help="one of the model's named prompts (default: the model's default prompt, if any)")
    embed.add_argument("--dimensions", type=int, default=None,
                       help="a shorter (Matryoshka) size: each vector cut to it and normalised again")
    classify = _command(commands, "classify", "classify texts")
    classify.add_argument("texts", nargs="+")
    classify.add_argument("--top-k", type=int, default=1)
    _command(commands, "ner", "named entities in texts").add_argument("texts", nargs="+")
    answer = _command(commands, "answer", "extractive question answering")
    answer.add_argument("question")
    answer.add_argument("--context", required=True)
    answer.add_argument("--top-k", type=int, default=1)
    rerank = _command(commands, "rerank", "rank documents by relevance to a query")
    rerank.add_argument("query")
    rerank.add_argument("documents", nargs="+")
    rerank.add_argument("--top-k", type=int, default=None)
