"""nexus-sli gateway with uvicorn's http/loop forced from SQ_HTTP / SQ_LOOP, and SQ_METRICS=asgi: a plain
ASGI metrics middleware (A/B measurement only)."""
import os, sys, time, uvicorn
orig = uvicorn.Config.__init__
def init(self, *a, **k):
    k.setdefault("http", os.environ.get("SQ_HTTP", "auto")); k.setdefault("loop", os.environ.get("SQ_LOOP", "auto"))
    orig(self, *a, **k)
uvicorn.Config.__init__ = init
if os.environ.get("SQ_METRICS") == "base":  # the middleware as it was: Starlette's BaseHTTPMiddleware
    from starlette.middleware.base import BaseHTTPMiddleware
    from nexus_sli.gateway import app as app_mod, metrics as m
    class Old(BaseHTTPMiddleware):
        def __init__(self, app, metrics):
            super().__init__(app); self.metrics = metrics
        async def dispatch(self, request, call_next):
            route, start = self.metrics.route(request.url.path), time.perf_counter()
            status = 500; counted = request.url.path not in m.NOT_IN_FLIGHT
            if counted: self.metrics.in_flight.inc()
            try:
                response = await call_next(request); status = response.status_code; return response
            finally:
                if counted: self.metrics.in_flight.dec()
                self.metrics.latency.labels(route, request.method).observe(time.perf_counter() - start)
                self.metrics.requests.labels(route, request.method, str(status)).inc()
    app_mod.MetricsMiddleware = Old
if os.environ.get("SQ_TIMING"):
    import atexit, json
    from nexus_sli.gateway import backend as b
    times = {"embed_counted": [], "embed": []}
    for meth in times:
        orig_m = getattr(b.Backend, meth)
        async def timed(self, *a, _o=orig_m, _n=meth, **k):
            t0 = time.perf_counter()
            try:
                return await _o(self, *a, **k)
            finally:
                times[_n].append((time.perf_counter() - t0) * 1e3)
        setattr(b.Backend, meth, timed)
    atexit.register(lambda: Path(f"gateway-timing-{os.environ['SQ_METRICS']}.json").write_text(json.dumps(times)))
    from pathlib import Path
from nexus_sli.cli.main import main
sys.exit(main(sys.argv[1:]))
