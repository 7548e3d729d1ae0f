"""Option values that can only fail later (a port past 65535, a negative timeout, a URL the client library cannot
read) are refused as the command line is parsed: exit 2, one line naming the option, no traceback."""

from __future__ import annotations

import pytest

from nexus_sli.cli.main import build_parser, main


def _refused(capsys, argv: list[str]) -> str:
    """The parser's error line for ``argv``: it exits 2 before any command runs."""
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize("argv, option", [
    # Triton binds a port past 65535 modulo 65536 and still reports the number asked for
    (["serve", "--http-port", "99999"], "--http-port"),
    (["serve", "--grpc-port", "0"], "--grpc-port"),
    (["serve", "--metrics-port", "-1"], "--metrics-port"),
    (["serve", "--gateway-port", "65536"], "--gateway-port"),
    (["gateway", "--port", "70000"], "--port"),
    (["gateway", "--port", "0"], "--port"),
    (["gateway", "--triton-timeout", "0"], "--triton-timeout"),
    (["gateway", "--triton-timeout", "nan"], "--triton-timeout"),
    (["gateway", "--triton-retry", "-1"], "--triton-retry"),
    (["gateway", "--discovery-ttl", "-5"], "--discovery-ttl"),
    (["gateway", "--max-inputs", "0"], "--max-inputs"),
    (["gateway", "--max-input-chars", "-1"], "--max-input-chars"),
    (["gateway", "--max-body-bytes", "0"], "--max-body-bytes"),
    (["build-plan", "--model", "m", "--workspace-gib", "0"], "--workspace-gib"),
    (["build-plan", "--model", "m", "--workspace-gib", "-1"], "--workspace-gib"),
    (["publish", "--to", "s3://bucket/prefix", "--endpoint-url", "not-a-url"], "--endpoint-url"),
    (["embed", "hi", "--model", "m", "--protocol", "http", "--url", "http://127.0.0.1:8000"], "--url"),
    (["embed", "hi", "--model", "m", "--url", "127.0.0.1:8001,https://other:8001"], "--url"),
])
def test_a_value_out_of_range_is_refused_naming_its_option(capsys, argv, option):
    line = _refused(capsys, argv)
    assert f"argument {option}: takes " in line, line


def test_the_limits_keep_the_values_they_document():
    """0 where it means none, and the bounds themselves, still parse."""
    serve = build_parser().parse_args(["serve", "--gateway-port", "0", "--http-port", "65535", "--grpc-port", "1"])
    assert (serve.gateway_port, serve.http_port, serve.grpc_port) == (0, 65535, 1)
    gateway = build_parser().parse_args(["gateway", "--triton-retry", "0", "--discovery-ttl", "0",
                                         "--triton-timeout", "0.5", "--max-inputs", "1"])
    assert (gateway.triton_retry, gateway.discovery_ttl, gateway.triton_timeout, gateway.max_inputs) == (0, 0, 0.5, 1)
    publish = build_parser().parse_args(["publish", "--to", "s3://b/p", "--endpoint-url", "http://127.0.0.1:8333"])
    assert publish.endpoint_url == "http://127.0.0.1:8333"
    embed = build_parser().parse_args(["embed", "hi", "--model", "m", "--url", "dns:///triton.svc:8001"])
    assert embed.url == "dns:///triton.svc:8001"


@pytest.mark.parametrize("url, message", [
    ("dns:///no-port", "is not dns:///HOST:PORT"),
    (",", "no server URL given"),
    ("a:8001,dns:///b:8001", "not both"),
])
def test_a_malformed_client_url_is_one_line_before_any_call(capsys, url, message):
    assert main(["embed", "hi", "--model", "m", "--url", url]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"nexus-sli: error: --url {url!r}: ") and message in line, line
