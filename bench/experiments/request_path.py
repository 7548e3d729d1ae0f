"""Where a short query's time goes, layer by layer, interleaved rounds; Triton's per-model statistics; gateway variants.

Usage: python bench/experiments/request_path.py REPO MODEL ROUNDS [gateway args]; SQ_BATCH=N adds N rounds of batches
of 32 (the OpenAI route against gRPC); SQ_VARIANTS=h11,asgi,both picks the gateway variants; SQ_TIMING=1 times the
gateway's Triton calls inside it (written to gateway-timing-*.json on exit).
"""
import asyncio, sys, time, json
from pathlib import Path
import numpy as np
import tritonclient.grpc as g
from nexus_sli.bench.served import Server, Gateway, ServedEmbedder, GatewayEmbedder, TeiEmbedder
from nexus_sli.bench.runners import ServedFacts, GraphEncoder, token_counts
from nexus_sli.bench import texts as text_set
from nexus_sli.bench.prepare import short_queries
from nexus_sli.client import AsyncEncoderClient

repo = Path(sys.argv[1]); name = sys.argv[2]; rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 6
gw_args = sys.argv[4:]
facts = ServedFacts.read(repo, name)
texts = text_set.bench_texts()
queries = short_queries(texts, token_counts(facts, texts), 100)

def stats(client):
    out = {}
    for m in client.get_inference_statistics().model_stats:
        s = m.inference_stats; n = s.success.count
        out[m.name] = dict(n=n, queue=s.queue.ns, cin=s.compute_input.ns, infer=s.compute_infer.ns, cout=s.compute_output.ns, total=s.success.ns)
    return out

def diff(a, b):
    res = {}
    for k in b:
        n = b[k]["n"] - a[k]["n"]
        if n:
            res[k] = {f: round((b[k][f] - a[k][f]) / n / 1e6, 3) for f in ("queue", "cin", "infer", "cout", "total")}
            res[k]["n"] = n
    return res

import os, subprocess, contextlib
from nexus_sli.bench import served as served_mod
_popen = subprocess.Popen
def popen(argv, *a, **k):
    if "nexus_sli.cli.main" in argv:
        i = argv.index("-m"); argv = argv[:i] + [str(Path(__file__).with_name("request_path_gateway.py"))] + argv[i + 2:]
    return _popen(argv, *a, **k)
served_mod.subprocess.Popen = popen
VARIANTS = {"h11": ("h11", "asyncio", "base"), "asgi": ("h11", "asyncio", "asgi"), "both": ("httptools", "uvloop", "asgi")}
if os.environ.get("SQ_VARIANTS"):
    VARIANTS = {k: v for k, v in VARIANTS.items() if k in os.environ["SQ_VARIANTS"].split(",")}
with Server(repo) as server, contextlib.ExitStack() as stack:
    gws = {}
    for v, (h, l, mm) in VARIANTS.items():
        os.environ["SQ_HTTP"], os.environ["SQ_LOOP"], os.environ["SQ_METRICS"] = h, l, mm
        gws[v] = stack.enter_context(Gateway(server.url("grpc"), *gw_args))
    graph = GraphEncoder.for_model(repo, facts)
    paths = {
        "in-process": lambda t: graph([t])[0],
    }
    emb = {"grpc": ServedEmbedder(server.url("grpc"), "grpc", name), "http": ServedEmbedder(server.url("http"), "http", name),
           **{f"openai-{v}": GatewayEmbedder(gw.url, "openai-http", name) for v, gw in gws.items()},
           **{f"tei-{v}": TeiEmbedder(gw.url, "tei-http", name) for v, gw in gws.items()}}
    for k, e in emb.items():
        paths[k] = (lambda e: lambda t: e.embed_with(e.client, [t])[0])(e)
    import http.client as hc, base64
    for v, gw in gws.items():
        host, port = gw.url.removeprefix("http://").rsplit(":", 1)
        conn = hc.HTTPConnection(host, int(port))
        def raw(t, conn=conn):
            b = json.dumps({"model": name, "input": [t], "encoding_format": "base64"})
            try:
                conn.request("POST", "/v1/embeddings", b, {"Content-Type": "application/json"}); body = conn.getresponse().read()
            except (BrokenPipeError, ConnectionResetError, hc.RemoteDisconnected):
                conn.close(); conn.request("POST", "/v1/embeddings", b, {"Content-Type": "application/json"}); body = conn.getresponse().read()
            return np.frombuffer(base64.b64decode(json.loads(body)["data"][0]["embedding"]), dtype="<f4")
        paths[f"openai-raw-{v}"] = raw
    import urllib.request
    def gwtime(gw):
        text = urllib.request.urlopen(gw.url + "/metrics").read().decode()
        out = {}
        for line in text.splitlines():
            if line.startswith("nexus_sli_gateway_request_duration_seconds_") and 'method="POST"' in line:
                key = line.split("{")[0].rsplit("_", 1)[1] + " " + line.split('route="')[1].split('"')[0]
                out[key] = float(line.rsplit(" ", 1)[1])
        return out
    # the gateway's own client, async grpc, outside the gateway
    loop = asyncio.new_event_loop()
    async def make():
        return AsyncEncoderClient(server.url("grpc"), protocol="grpc")
    aclient = loop.run_until_complete(make())
    paths["aio-grpc"] = lambda t: loop.run_until_complete(aclient.embed_counted([t], model=name))[0][0]
    tc = g.InferenceServerClient(server.url("grpc"))
    for f in paths.values():
        for q in queries[:8]:
            f(q)
    res = {k: [] for k in paths}
    per_round = {k: [] for k in paths}
    st = {}; gwin = {}
    for r in range(rounds):
        order = list(paths) if r % 2 == 0 else list(reversed(paths))
        for k in order:
            before = stats(tc); gb = {v: gwtime(gw) for v, gw in gws.items()}
            lat = []
            for q in queries:
                t0 = time.perf_counter(); paths[k](q); lat.append((time.perf_counter() - t0) * 1e3)
            after = stats(tc); ga = {v: gwtime(gw) for v, gw in gws.items()}
            for v in gws:
                for route in ("/v1/embeddings", "/embed"):
                    n = ga[v].get("count " + route, 0) - gb[v].get("count " + route, 0)
                    if n:
                        gwin.setdefault((k, v, route), []).append((ga[v]["sum " + route] - gb[v]["sum " + route]) / n * 1e3)
            res[k] += lat; per_round[k].append(float(np.median(lat)))
            st.setdefault(k, []).append(diff(before, after))
    base = per_round["in-process"]
    for k in paths:
        ratios = [a / b for a, b in zip(per_round[k], base)]
        print(f"{k:12s} p50 {np.percentile(res[k],50):6.2f} p99 {np.percentile(res[k],99):6.2f}  per-round p50 {[round(x,2) for x in per_round[k]]}  vs in-process median {np.median(ratios):.2f}x")
    for k in [p for p in paths if p.startswith(("openai", "tei"))] + ["aio-grpc"]:
        print(k, "diff vs grpc per round", [round(a - b, 2) for a, b in zip(per_round[k], per_round["grpc"])])
    for key, v in gwin.items():
        print("gateway-side mean ms", key, [round(x, 2) for x in v])
    def agg(k):
        out = {}
        for m in st[k][0]:
            out[m.rsplit("_", 1)[1]] = {f: round(float(np.median([d[m][f] for d in st[k] if m in d])), 3) for f in ("queue", "infer", "total")}
        return out
    for k in st:
        if st[k][0]:
            print("triton", k, agg(k))
    for e in emb.values(): e.close()
    # batches of 32: the OpenAI route against the client over gRPC, interleaved rounds
    if os.environ.get("SQ_BATCH"):
        batches = [texts[i:i + 32] for i in range(0, 320, 32)]
        emb = {"grpc": ServedEmbedder(server.url("grpc"), "grpc", name),
               **{f"openai-{v}": GatewayEmbedder(gw.url, "openai-http", name) for v, gw in gws.items()}}
        rates = {k: [] for k in emb}
        for k, e in emb.items():
            e.embed_with(e.client, batches[0])
        for r in range(int(os.environ["SQ_BATCH"])):
            for k in (list(emb) if r % 2 == 0 else list(reversed(emb))):
                e = emb[k]; t0 = time.perf_counter()
                for b in batches:
                    e.embed_with(e.client, b)
                rates[k].append(320 / (time.perf_counter() - t0))
        for k in emb:
            print(f"batch32 {k:12s} texts/s {[round(x, 1) for x in rates[k]]} vs grpc median {np.median([a / b for a, b in zip(rates[k], rates['grpc'])]):.3f}")
