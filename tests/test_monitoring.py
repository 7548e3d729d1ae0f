"""Every metric the monitoring uses exists: the real Triton server and a real gateway on loopback,
some traffic (one request that fails in Triton, one the gateway refuses), both ``/metrics``
scraped as the PodMonitors do (the gateway's with its API key), and every metric and label name in
the Grafana dashboard's queries, the autoscalers' metrics and the prometheus-adapter rules found
in those scrapes.  The names are read out of deploy/k8s, not listed here.

What Prometheus itself adds to each series (the target's ``namespace``, ``pod``, ...) is not in
a scrape; :data:`TARGET_LABELS` names those.  No Prometheus runs here: the queries are read, not
evaluated."""

from __future__ import annotations

import contextlib
import re
import secrets
import urllib.error
import urllib.request
from typing import NamedTuple

import numpy as np
import openai
import pytest
import tritonclient.grpc as grpcclient

from nexus_sli.bench.served import Gateway, free_ports
from nexus_sli.exporter.serving import server as serve
from nexus_sli.gateway.config import API_KEY_ENV
from helpers.servers import end_now
from helpers.waiting import wait_until
from helpers.serving_paths import JOINED, PATHS, joined_models, per_path, start_options
from helpers.exports import MINILM
from helpers.k8s import adapter_rules, by_name, dashboard, render

#: Labels the Prometheus operator puts on every series it scrapes for a PodMonitor (from the target,
#: not the scrape); ``instance`` and ``job`` are Prometheus' own.
TARGET_LABELS = frozenset({"namespace", "pod", "container", "endpoint", "job", "instance"})
#: What prometheus-adapter puts in a rule's query for a Pods metric: matchers on the resource labels,
#: grouped by pod (its ``<<.LabelMatchers>>`` and ``<<.GroupBy>>`` templates).
ADAPTER_TEMPLATES = {"<<.LabelMatchers>>": 'namespace="serving",pod=~"p1|p2"', "<<.GroupBy>>": "pod"}


# --- reading PromQL -------------------------------------------------------------------------------

_TOKENS = re.compile(r"""
    (?P<string>"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*'|`[^`]*`)
  | (?P<range>\[[^\]]*\])
  | (?P<number>(?<![\w:.])(?:\d+\.?\d*(?:[eE][+-]?\d+)?|\.\d+)(?![\w:]))
  | (?P<name>[A-Za-z_:][\w:]*)
  | (?P<op>=~|!~|!=|==|>=|<=|[-+*/%^=<>(){},])
  | (?P<space>\s+)
""", re.VERBOSE)
#: Words followed by a list of label names.
_GROUPING = {"by", "without", "on", "ignoring", "group_left", "group_right"}
_BINARY = {"and", "or", "unless", "bool"}
#: The functions these queries may call; an unknown one (a typo) is an error, not a metric name.
_FUNCTIONS = {"sum", "avg", "min", "max", "count", "topk", "bottomk", "quantile", "rate", "irate", "increase",
              "delta", "histogram_quantile", "clamp_min", "clamp_max", "abs", "avg_over_time", "max_over_time",
              "min_over_time", "sum_over_time", "label_values"}


class Query:
    """The metric and label names one PromQL expression uses: each selector's metric with the labels
    its matchers name, and the labels it groups or matches by."""

    def __init__(self, text: str):
        self.text = text
        self.selectors: list[tuple[str, set[str]]] = []
        self.grouping: set[str] = set()
        tokens = [(m.lastgroup, m.group()) for m in _TOKENS.finditer(text) if m.lastgroup != "space"]
        if sum(len(value) for _, value in tokens) != len(re.sub(r"\s", "", text)):
            raise ValueError(f"characters PromQL does not have in {text!r}")
        i = 0
        while i < len(tokens):
            kind, value = tokens[i]
            following = tokens[i + 1][1] if i + 1 < len(tokens) else None
            if kind == "name" and value in _GROUPING:
                i = self._names(tokens, i + 1, self.grouping) if following == "(" else i + 1
            elif kind == "name" and value in _BINARY:
                i += 1
            elif kind == "name" and (following == "(" or following in _GROUPING):  # sum by (x) (...)
                if value not in _FUNCTIONS:
                    raise ValueError(f"unknown function {value!r} in {text!r}")
                i += 1
            elif kind == "name":
                labels: set[str] = set()
                i = self._names(tokens, i + 1, labels, matchers=True) if following == "{" else i + 1
                self.selectors.append((value, labels))
            elif value == "{":
                raise ValueError(f"a selector without a metric name in {text!r}: not read here")
            else:
                i += 1
        if not self.selectors:
            raise ValueError(f"no metric in {text!r}")

    @staticmethod
    def _names(tokens: list, i: int, into: set[str], matchers: bool = False) -> int:
        """Collects the label names of a ``(a, b)`` list or a ``{a="x", b=~"y"}`` block opening at
        ``tokens[i]``; the index after its end."""
        close = "}" if matchers else ")"
        i += 1
        while tokens[i][1] != close:
            kind, value = tokens[i]
            if kind == "name":
                into.add(value)
                i += 3 if matchers else 1  # name, operator, "value"
            else:
                i += 1
        return i + 1

    @property
    def metrics(self) -> set[str]:
        return {metric for metric, _ in self.selectors}


def dashboard_queries() -> list[Query]:
    """Every panel's queries and every template variable's ``label_values(selector, label)``."""
    board = dashboard()
    queries = [Query(t["expr"]) for p in board["panels"] for t in p.get("targets", [])]
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            selector, label = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", variable["query"]).groups()
            query = Query(selector)
            query.grouping.add(label)
            queries.append(query)
    return queries


def adapter_queries(rule: dict) -> list[Query]:
    """A prometheus-adapter rule's series query and its metrics query, templates filled in as the adapter does."""
    metrics_query = rule["metricsQuery"]
    for template, value in ADAPTER_TEMPLATES.items():
        metrics_query = metrics_query.replace(template, value)
    return [Query(rule["seriesQuery"]), Query(metrics_query)]


def autoscaler_queries() -> dict[str, list[Query]]:
    """Per HorizontalPodAutoscaler, the queries behind its metrics (through the adapter's rules)."""
    rules = adapter_rules()
    found = {}
    for (kind, name), hpa in by_name(render("cpu")).items():
        if kind != "HorizontalPodAutoscaler":
            continue
        found[name] = []
        for metric in hpa["spec"]["metrics"]:
            # Pods metrics only: any other kind would come from somewhere this test does not read
            assert metric["type"] == "Pods", metric
            found[name] += adapter_queries(rules[metric["pods"]["metric"]["name"]])
    assert found, "no autoscaler rendered"
    return found


def problems(queries: list[Query], scraped: dict[str, set[str]]) -> list[str]:
    """Each metric a query reads that no scrape has, and each label it names that the metric lacks
    (beyond what Prometheus adds to a target's series)."""
    found = []
    for query in queries:
        for metric, labels in query.selectors:
            if metric not in scraped:
                found.append(f"{metric} (in {query.text!r}) is not scraped")
            elif labels - scraped[metric] - TARGET_LABELS:
                found.append(f"{metric} has no label {sorted(labels - scraped[metric] - TARGET_LABELS)}")
        for metric in query.metrics & set(scraped):  # grouping and vector matching need it on every side
            if query.grouping - scraped[metric] - TARGET_LABELS:
                found.append(f"{query.text!r} groups by {sorted(query.grouping - scraped[metric] - TARGET_LABELS)}"
                             f", which {metric} lacks")
    return found


def test_the_query_reader_finds_metrics_and_labels_and_nothing_else():
    query = Query('histogram_quantile(0.99, sum by (le, route) (rate(a_bucket{namespace="$ns", '
                  'route!~"/health|b_total"}[$__rate_interval]))) / on (route) group_left sum(c:rule) by (pod) > 0.5')
    assert query.selectors == [("a_bucket", {"namespace", "route"}), ("c:rule", set())]
    assert query.grouping == {"le", "route", "pod"}
    assert Query("count(count by (pod) (x))").selectors == [("x", set())]
    for wrong in ("rat(x[1m])", '{__name__="x"}', "sum(1)", "x # y"):
        with pytest.raises(ValueError):
            Query(wrong)
    # every query deploy/k8s holds reads without error, and names at least one metric
    assert dashboard_queries() and all(q.metrics for q in dashboard_queries())
    assert all(q.metrics for rule in adapter_rules().values() for q in adapter_queries(rule))


# --- the real servers -----------------------------------------------------------------------------

def _get(url: str, key: str | None = None) -> tuple[int, str]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


_SAMPLE = re.compile(r'^([A-Za-z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\S+)?$')
_LABEL = re.compile(r'(\w+)="((?:\\.|[^"\\])*)"')


class Sample(NamedTuple):
    name: str
    labels: dict[str, str]
    value: float


def _samples(text: str) -> list[Sample]:
    """The samples of Prometheus' text format, named as Prometheus stores them.  (prometheus_client's
    parser renames a counter's samples ``*_total``; Triton's counters have no such suffix, and the
    queries must use the names as exposed.)"""
    found = []
    for line in text.splitlines():
        if line.strip() and not line.startswith("#"):
            name, labels, value = _SAMPLE.match(line).groups()
            found.append(Sample(name, dict(_LABEL.findall(labels or "")), float(value)))
    return found


@pytest.fixture(scope="module")
def repository(tmp_path_factory, exports):
    # the packaged MiniLM, fp32 on ONNX Runtime (the API's defaults: no `auto` search), one model is enough
    return exports.copy(MINILM, tmp_path_factory.mktemp("monitoring") / "repo", as_name="minilm")


@pytest.fixture(scope="module")
def scrapes(repository, tmp_path_factory):
    with per_path(lambda path: _scraped(repository, tmp_path_factory, path)) as scrape:
        yield scrape


@pytest.fixture(params=PATHS)
def scraped(request, scrapes):
    """Triton and the gateway after some traffic: {"path", "triton": text, "gateway": text, "unauthorised": status,
    "triton_idle": Triton's scrape before the traffic}; served as a Kubernetes pod's tritonserver serves the steps
    (separate), and as nexus-sli serve does by default."""
    return scrapes(request.param)


#: The requests the traffic below sends to Triton's ``minilm``: two through the gateway, one not UTF-8.
SENT = 3


def _counted(url: str, model: str, requests: int) -> str | None:
    """Triton's scrape once it counts ``requests`` answered by ``model``, a success or a failure; None before.
    Triton counts a request when it releases it, which can come after the client has its answer (seen with an
    ensemble's failure, in a fresh clone's run): a scrape taken at once can miss the last one."""
    status, text = _get(url)
    assert status == 200
    answered = sum(s.value for s in _samples(text) if s.labels.get("model") == model
                   and s.name in ("nv_inference_request_success", "nv_inference_request_failure"))
    return text if answered >= requests else None


@contextlib.contextmanager
def _scraped(repository, tmp_path_factory, path: str):
    root = tmp_path_factory.mktemp(f"monitoring-{path}")
    http, grpc, metrics = free_ports(3)
    process = serve.start(repository, http, grpc, metrics, **start_options(path))
    key = secrets.token_urlsafe(16)
    try:
        with pytest.MonkeyPatch.context() as env:
            env.setenv(API_KEY_ENV, key)  # as the Deployment passes it: the Secret in the environment
            gateway = Gateway(f"127.0.0.1:{grpc}", timeout_s=120, log=root / "gateway.log").start()
        try:
            # before the traffic: what the steps count here is the encoder's warm-up
            status, idle_text = _get(f"http://127.0.0.1:{metrics}/metrics")
            assert status == 200
            sdk = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0)
            assert len(sdk.embeddings.create(model="minilm", input=["a text", "another"]).data) == 2
            assert len(sdk.embeddings.create(model="minilm", input="one more").data) == 1
            with pytest.raises(openai.NotFoundError):  # refused by the gateway: counted with its status
                sdk.embeddings.create(model="no-such-model", input="x")
            # a request that fails inside Triton: bytes that are not UTF-8 (no JSON client can send them)
            text = grpcclient.InferInput("TEXT", [1, 1], "BYTES")
            text.set_data_from_numpy(np.array([[b"\xff\xfe"]], dtype=object))
            with pytest.raises(grpcclient.InferenceServerException):
                grpcclient.InferenceServerClient(f"127.0.0.1:{grpc}").infer("minilm", [text])
            triton_text = wait_until(lambda: _counted(f"http://127.0.0.1:{metrics}/metrics", "minilm", SENT),
                                     f"Triton's /metrics to count the {SENT} requests sent to minilm", timeout=30)
            unauthorised, _ = _get(f"{gateway.url}/metrics")
            status, gateway_text = _get(f"{gateway.url}/metrics", key)  # as the gateway's PodMonitor sends it
            assert status == 200
            assert joined_models(f"127.0.0.1:{http}", ["minilm"]) == ({"minilm"} if path == JOINED else set())
            yield {"path": path, "triton": triton_text, "gateway": gateway_text,
                   "unauthorised": unauthorised, "triton_idle": idle_text}
        finally:
            gateway.stop()
    finally:
        end_now(process)


@pytest.fixture
def names(scraped) -> dict[str, set[str]]:
    """Each series name in the two scrapes, with every label name it carries."""
    found: dict[str, set[str]] = {}
    for sample in _samples(scraped["triton"]) + _samples(scraped["gateway"]):
        found.setdefault(sample.name, set()).update(sample.labels)
    return found


def test_every_metric_and_label_the_dashboard_uses_is_scraped(names):
    assert problems(dashboard_queries(), names) == []


def test_every_metric_the_autoscalers_scale_on_is_scraped(names):
    for hpa, queries in autoscaler_queries().items():
        assert problems(queries, names) == [], hpa


def test_every_metric_the_adapter_rules_read_is_scraped(names):
    for name, rule in adapter_rules().items():
        assert problems(adapter_queries(rule), names) == [], name


def test_a_misspelt_metric_or_label_is_caught(names):
    # the check is not vacuous: one letter off in a metric, or a label Triton does not have
    for text in ("sum(rate(nv_inference_request_succes[1m]))", "sum by (modle) (rate(nv_inference_count[1m]))",
                 'nexus_sli_gateway_requests_total{path="/v1/embeddings"}',
                 "sum by (route) (nv_inference_count) / sum by (route) (nexus_sli_gateway_requests_total)"):
        assert problems([Query(text)], names), text


def test_the_scrapes_count_the_traffic(scraped):
    """Not only names: the series the dashboard shows moved with the requests sent."""
    triton = _samples(scraped["triton"])
    gateway = _samples(scraped["gateway"])

    def total(samples, name, **labels) -> float:
        return sum(s.value for s in samples if s.name == name and labels.items() <= s.labels.items())

    if scraped["path"] == JOINED:
        # one model under the ensemble's name runs every step, and answers each request itself: the request that
        # is not UTF-8 is answered with its error, which Triton counts as a success (docs/serving.md); the
        # steps' own models counted none of the traffic
        idle = _samples(scraped["triton_idle"])
        assert total(triton, "nv_inference_request_success", model="minilm") == 3
        assert total(triton, "nv_inference_request_failure", model="minilm") == 0
        assert total(triton, "nv_inference_count", model="minilm") == 4  # texts
        assert total(triton, "nv_inference_queue_duration_us", model="minilm") > 0
        for step in ("minilm_tokenizer", "minilm_encoder"):
            assert total(triton, "nv_inference_count", model=step) == total(idle, "nv_inference_count", model=step)
    else:
        assert total(triton, "nv_inference_request_success", model="minilm") >= 2
        assert total(triton, "nv_inference_request_failure", model="minilm") >= 1  # the bytes that are not UTF-8
        assert total(triton, "nv_inference_queue_duration_us", model="minilm_encoder") > 0
    assert total(gateway, "nexus_sli_gateway_requests_total", route="/v1/embeddings", status="200") == 2
    assert total(gateway, "nexus_sli_gateway_requests_total", route="/v1/embeddings", status="404") == 1
    assert total(gateway, "nexus_sli_gateway_request_duration_seconds_count", route="/v1/embeddings") == 3
    # idle now: the scrape itself is not counted as load, so the autoscaler sees 0
    assert total(gateway, "nexus_sli_gateway_requests_in_flight") == 0
    # the gateway's /metrics needs its key: the PodMonitor's authorization is not optional
    assert scraped["unauthorised"] == 401


def test_in_flight_counts_requests_being_answered_not_probes_or_scrapes():
    """The gateway autoscaler's gauge, in a real app: a request sees itself counted, a scrape does
    not, and a request that fails is uncounted again."""
    from starlette.responses import JSONResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    from nexus_sli.gateway import GatewayConfig, create_app

    name = "nexus_sli_gateway_requests_in_flight"

    async def during(request):
        return JSONResponse({"in_flight": request.app.state.metrics.registry.get_sample_value(name)})

    async def broken(request):
        raise RuntimeError("a bug")

    app = create_app(GatewayConfig(triton_timeout_s=5))  # no Triton there: /health answers 503
    app.router.routes += [Route("/v1/during", during), Route("/v1/broken", broken)]
    with TestClient(app, raise_server_exceptions=False) as client:
        assert client.get("/v1/during").json()["in_flight"] == 1
        assert client.get("/v1/broken").status_code == 500
        assert client.get("/health").status_code == 503
        scrape = {s.name: s.value for s in _samples(client.get("/metrics").text)}
        assert scrape[name] == 0
