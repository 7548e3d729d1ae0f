"""``nexus-sli gateway``: OpenAI's and TEI's HTTP APIs in front of a running Triton server."""

from __future__ import annotations

import argparse
import os

from .arguments import int_at_least_0, port, positive_int, positive_seconds, seconds_at_least_0


def add_parser(commands) -> None:
    from nexus_sli.gateway.config import API_KEY_ENV, GatewayConfig

    defaults = GatewayConfig()
    gateway = commands.add_parser("gateway", help="serve OpenAI /v1/embeddings and TEI /embed /rerank /predict "
                                  "in front of Triton (docs/gateway.md)")
    gateway.add_argument("--triton", default=defaults.triton, type=_one_triton,
                         help="Triton's gRPC address (default %(default)s), or dns:///NAME:PORT: every address of "
                              "NAME (a Kubernetes headless Service), requests spread over them, resolved again "
                              "every 10 s")
    gateway.add_argument("--host", default=defaults.host,
                         help=f"address to bind (default loopback only; set {API_KEY_ENV} before exposing it)")
    gateway.add_argument("--port", type=port, default=defaults.port)
    gateway.add_argument("--api-key", default=None,
                         help=f"require 'Authorization: Bearer KEY' (default: the {API_KEY_ENV} environment "
                              "variable, the better way: a value given here is visible in the process list; "
                              "none: no key)")
    gateway.add_argument("--tei-model", default=None,
                         help="the model TEI's routes (/embed, /rerank, /predict) use when a request names none "
                              "(default: the one model serving that task)")
    gateway.add_argument("--max-inputs", type=positive_int, default=defaults.max_inputs, help="texts per request")
    gateway.add_argument("--max-input-chars", type=positive_int, default=defaults.max_input_chars,
                         help="characters per text")
    gateway.add_argument("--max-body-bytes", type=positive_int, default=defaults.max_body_bytes,
                         help="bytes per request body")
    gateway.add_argument("--max-token-vectors", type=positive_int, default=defaults.max_token_vectors,
                         help="vectors per /embed_all or /embed_multi_vector answer, each text counted at its "
                              "model's max_length (default %(default)s, TEI's --max-batch-tokens)")
    gateway.add_argument("--max-concurrent-requests", type=int_at_least_0, default=defaults.max_concurrent_requests,
                         help="inference requests answered at once; past it a request is refused at once with 429 "
                              "and Retry-After, as TEI's flag of that name (default %(default)s; 0: no bound)")
    gateway.add_argument("--triton-timeout", type=positive_seconds, default=defaults.triton_timeout_s,
                         help="seconds a call to Triton may take before the answer is a 503 (default %(default)s)")
    gateway.add_argument("--triton-retry", type=seconds_at_least_0, default=defaults.triton_retry_s,
                         help="seconds one request keeps retrying Triton's retryable failures (a worker restarting, "
                              "a model reloading) before the answer is a 503 (default %(default)s; 0: none)")
    gateway.add_argument("--discovery-ttl", type=seconds_at_least_0, default=defaults.discovery_ttl_s,
                         help="seconds the list of served models is kept before it is read from Triton again (a "
                              "model swapped or added is seen within it; default %(default)s)")
    gateway.set_defaults(run=run)


def _one_triton(value: str) -> str:
    from nexus_sli.gateway.config import check_triton

    try:
        return check_triton(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def config_from(args: argparse.Namespace):
    from nexus_sli.gateway.config import API_KEY_ENV, GatewayConfig

    return GatewayConfig(triton=args.triton, host=args.host, port=args.port,
                         api_key=args.api_key or os.environ.get(API_KEY_ENV) or None, tei_model=args.tei_model,
                         max_inputs=args.max_inputs, max_input_chars=args.max_input_chars,
                         max_body_bytes=args.max_body_bytes, max_token_vectors=args.max_token_vectors,
                         triton_timeout_s=args.triton_timeout,
                         triton_retry_s=args.triton_retry, max_concurrent_requests=args.max_concurrent_requests,
                         discovery_ttl_s=args.discovery_ttl)


def run(args: argparse.Namespace) -> int:
    from nexus_sli.gateway import serve

    return serve(config_from(args))
