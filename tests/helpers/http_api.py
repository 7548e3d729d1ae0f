"""Plain HTTP calls, and TEI's OpenAPI description as the judge of the gateway's shapes."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

TEI = json.loads((Path(__file__).resolve().parents[1] / "data" / "tei" / "openapi.json").read_text())


def call(url: str, body=None, headers: dict | None = None, raw: bytes | None = None):
    """(status, headers, parsed JSON or text) of one plain HTTP request."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            status, head, payload = response.status, response.headers, response.read()
    except urllib.error.HTTPError as exc:
        status, head, payload = exc.code, exc.headers, exc.read()
    try:
        return status, head, json.loads(payload)
    except ValueError:
        return status, head, payload.decode()


def _resolve(schema: dict) -> dict:
    while "$ref" in schema:
        schema = TEI["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
    return schema


def schema_problems(value, schema: dict, where: str = "$") -> list[str]:
    """Where ``value`` breaks ``schema`` (the OpenAPI 3.0 subset TEI's description uses)."""
    schema = _resolve(schema)
    if value is None and schema.get("nullable"):
        return []
    if "oneOf" in schema:
        fits = [option for option in schema["oneOf"] if not schema_problems(value, option, where)]
        return [] if len(fits) >= 1 else [f"{where}: {value!r:.60} matches none of oneOf"]
    if "allOf" in schema:
        return [p for option in schema["allOf"] for p in schema_problems(value, option, where)]
    kind = schema.get("type")
    types = {"object": dict, "array": list, "string": str, "boolean": bool, "integer": int, "number": (int, float)}
    if kind and (not isinstance(value, types[kind]) or (kind in ("integer", "number") and isinstance(value, bool))):
        return [f"{where}: {type(value).__name__} is not {kind}"]
    if "enum" in schema and value not in schema["enum"]:
        return [f"{where}: {value!r} not in {schema['enum']}"]
    problems = []
    if kind == "array":
        for bound, ok in (("minItems", len(value) >= schema.get("minItems", 0)),
                          ("maxItems", len(value) <= schema.get("maxItems", len(value)))):
            problems += [] if ok else [f"{where}: {bound}"]
        for i, item in enumerate(value):
            problems += schema_problems(item, schema.get("items", {}), f"{where}[{i}]")
    if kind == "object":
        properties, extra = schema.get("properties", {}), schema.get("additionalProperties")
        problems += [f"{where}: missing {k}" for k in schema.get("required", []) if k not in value]
        # a map (additionalProperties: its values' schema) takes any key; any other object only its fields
        problems += [f"{where}: {k} is no field of TEI's schema" for k in value if k not in properties and not extra]
        for k, v in value.items():
            if k in properties or extra:
                problems += schema_problems(v, properties.get(k, extra), f"{where}.{k}")
    return problems


def tei_schema(name: str) -> dict:
    return TEI["components"]["schemas"][name]


def tei(gateway, route: str, body: dict, request_schema: str):
    """``call`` of the gateway's TEI ``route``, the body first checked against TEI's ``request_schema``
    ("model" is ours: TEI serves one model, the gateway may serve several of a task)."""
    theirs = {k: v for k, v in body.items() if k != "model"}
    assert schema_problems(theirs, tei_schema(request_schema)) == [], "the test sends what TEI defines"
    return call(f"{gateway.url}{route}", body)
