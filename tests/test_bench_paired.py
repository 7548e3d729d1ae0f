"""Target (f)'s batches sent in turn, and the OpenAI route's single queries split into the route's cost
and the SDK's: the turn order, the pairing of the two sides' samples, the judging and the page.

No server, no model: the senders are scripted and the rows synthetic.
"""

from __future__ import annotations

import numpy as np
import pytest

from helpers.bench_rows import DEFAULT, by_comparison, run_rows
from nexus_sli.bench import targets as bench_targets
from nexus_sli.bench.measure import Measurement
from nexus_sli.bench.paired import TakingTurns, turn_order

BATCHES = "OpenAI route batches of 32 vs gRPC's"


def test_every_batch_goes_to_both_sides_the_first_alternating():
    assert turn_order(3, 2, 0) == [(0, 0), (0, 1), (1, 1), (1, 0), (2, 0), (2, 1)]
    assert turn_order(2, 2, 1) == [(0, 1), (0, 0), (1, 0), (1, 1)]
    assert turn_order(0, 2, 0) == []


def test_every_batch_goes_to_every_side_each_taking_each_place_equally_often():
    order = turn_order(6, 3, 1)
    assert order[:9] == [(0, 1), (0, 2), (0, 0), (1, 2), (1, 0), (1, 1), (2, 0), (2, 1), (2, 2)]
    assert all(sorted(s for b, s in order if b == batch) == [0, 1, 2] for batch in range(6))
    places = [(side, place) for batch in range(6) for place, (_, side) in enumerate(order[3 * batch:3 * batch + 3])]
    assert all(places.count((side, place)) == 2 for side in range(3) for place in range(3))


class _Clock:
    """The paired module's clock: each request moves it by its side's own time, so the samples are known."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _scripted(monkeypatch, seconds: tuple[float, ...]):
    """A sender a side logging (side, texts) and taking ``seconds[side]`` per request on a fake clock."""
    import nexus_sli.bench.paired as paired

    clock, sent = _Clock(), []
    monkeypatch.setattr(paired, "perf_counter", clock)

    def sender(side: int):
        def send(texts: list[str]) -> np.ndarray:
            sent.append((side, list(texts)))
            clock.now += seconds[side]
            return np.full((len(texts), 2), float(side))
        return send
    return (*(sender(side) for side in range(len(seconds))), sent)


def test_each_side_is_timed_on_its_own_requests_and_the_start_alternates_between_runs(monkeypatch):
    first, second, sent = _scripted(monkeypatch, (0.1, 0.3))
    turns = TakingTurns(first, second, batch_size=2)
    texts = [f"t{i}" for i in range(5)]
    one, two = turns.run(texts)
    assert [side for side, _ in sent] == [0, 1, 1, 0, 0, 1]
    # both sides sent the same batches, in the same order
    assert [t for side, t in sent if side == 0] == [t for side, t in sent if side == 1] == [
        ["t0", "t1"], ["t2", "t3"], ["t4"]]
    # each side's time is the sum of its own requests', not the run's wall clock
    assert one.seconds == pytest.approx(0.3) and two.seconds == pytest.approx(0.9)
    assert one.latencies_ms == pytest.approx([100.0] * 3) and one.count == two.count == 5
    assert (one.embeddings == 0).all() and (two.embeddings == 1).all()
    sent.clear()
    turns.run(texts[:2])  # the next run starts with the other side
    assert [side for side, _ in sent] == [1, 0]


def test_the_side_timed_first_runs_both_and_the_other_takes_its_sample(monkeypatch):
    first, second, sent = _scripted(monkeypatch, (0.2, 0.1))
    turns = TakingTurns(first, second, batch_size=2)
    texts = ["a", "b", "c", "d"]
    grpc = Measurement("triton", "fp32", "grpc", "paired32", texts, [1] * 4, turns.side(0), sliced=True)
    openai = Measurement("gateway", "fp32", "openai-http", "paired32", texts, [1] * 4, turns.side(1), sliced=True)
    # repetition 0: gRPC is timed first (it runs both); repetition 1: the OpenAI route is
    for repetition, order in ((0, (grpc, openai)), (1, (openai, grpc))):
        for m in order:
            m.time_once(repetition, slices=2)
    assert len(sent) == 4 and turns.runs == 2  # one batch of the slice's two texts, to each side, twice
    assert [s.indices for s in grpc.samples] == [s.indices for s in openai.samples] == [[0, 2], [1, 3]]
    assert grpc.rates() == pytest.approx([10.0, 10.0]) and openai.rates() == pytest.approx([20.0, 20.0])
    assert bench_targets.paired_ratios(openai.rates(), grpc.rates()) == pytest.approx([2.0, 2.0])


def test_three_sides_each_take_their_sample_of_the_run_the_first_timed_makes(monkeypatch):
    *senders, sent = _scripted(monkeypatch, (0.1, 0.2, 0.4))
    turns = TakingTurns(*senders, batch_size=2)
    texts = list("abcdef")
    sides = [Measurement(path, "fp32", protocol, "paired32", texts, [1] * 6, turns.side(which), sliced=True)
             for which, (path, protocol) in enumerate(
                 (("triton", "grpc"), ("gateway", "openai-http"), ("gateway", "openai-http-plain")))]
    # each repetition another side is timed first: it runs all three, the others take their samples
    for repetition in range(3):
        for m in sides[repetition:] + sides[:repetition]:
            m.time_once(repetition, slices=3)
    assert turns.runs == 3 and [side for side, _ in sent] == [0, 1, 2, 1, 2, 0, 2, 0, 1]
    assert all(side.samples[r].indices == sides[0].samples[r].indices for side in sides for r in range(3))
    assert [m.rates() for m in sides] == [pytest.approx([r] * 3) for r in (20.0, 10.0, 5.0)]


def test_the_batch_bound_reads_the_batches_sent_in_turn():
    # in blocks the route reads 0.95-0.97x gRPC's; sent in turn 0.8x, repetition by repetition
    rows = run_rows(paired=((200, 216, 208), (250, 270, 260)))
    batches = by_comparison(bench_targets.evaluate(rows, DEFAULT))[("(f)", BATCHES)]
    assert batches["comparison"] == f"{BATCHES} (sent in turn, request by request)"
    assert batches["per_repetition"] == pytest.approx([0.8, 0.8, 0.8]) and batches["status"] == "not met"
    # a run from before they were sent in turn keeps its blocks, and says so
    old = by_comparison(bench_targets.evaluate(run_rows(), DEFAULT))[("(f)", BATCHES)]
    assert old["comparison"].endswith("(in blocks: a run from before they were sent in turn)")
    assert old["median"] == pytest.approx(295 / 305)


def test_the_plain_routes_batches_are_shown_beside_the_bound_they_do_not_change():
    # through the SDK 0.8x gRPC's, from plain HTTP 0.96x, repetition by repetition
    rows = run_rows(paired=((200, 216, 208), (250, 270, 260)), plain_paired=(240, 259.2, 249.6))
    batches = by_comparison(bench_targets.evaluate(rows, DEFAULT))[("(f)", BATCHES)]
    assert batches["per_repetition"] == pytest.approx([0.8, 0.8, 0.8]) and batches["status"] == "not met"
    assert batches["comparison"] == (f"{BATCHES} (sent in turn, request by request; through the openai SDK; "
                                     "the route from plain HTTP over gRPC: 0.96x)")


def test_the_sdks_share_is_shown_beside_the_bound_it_does_not_change():
    # through the SDK 6.2-6.5 ms, plain HTTP 5.6-5.8 ms, gRPC 5.0-5.2 ms
    rows = run_rows(plain_p50=(5.6, 5.8, 5.6))
    single = [t for t in bench_targets.evaluate(rows, DEFAULT) if t["comparison"].startswith("OpenAI route p50")]
    (single,) = single
    assert single["median"] == pytest.approx(1.2)  # judged on the SDK's p50, as without the plain row
    assert single["comparison"].endswith("the SDK's own share, its p50 minus plain HTTP's on the route: 0.70 ms)")


def test_the_page_shows_the_plain_route_the_split_and_the_batches_in_turn():
    from nexus_sli.bench.report import request_path_section

    rows = run_rows(paired=((200, 216, 208), (250, 270, 260)), plain_p50=(5.6, 5.8, 5.6))
    section = "\n".join(request_path_section({"rows": rows, "default_configuration": DEFAULT}))
    assert "| gateway, OpenAI `/v1/embeddings` (plain HTTP, the SDK's JSON body) | 5.60 |" in section
    assert "the route itself, its p50 from a plain HTTP client minus gRPC's, +0.60 ms" in section
    assert "the SDK's p50 minus plain HTTP's, +0.70 ms" in section and "what target (f) bounds, +1.20 ms" in section
    assert "by repetition 0.80x, 0.80x, 0.80x (median 0.80x)" in section
    assert "from a plain HTTP client (the SDK's JSON body), sent in turn" not in section
    rows = run_rows(paired=((200, 216, 208), (250, 270, 260)), plain_paired=(240, 259.2, 249.6))
    section = "\n".join(request_path_section({"rows": rows, "default_configuration": DEFAULT}))
    assert ("sent in turn with both: 249.6 texts/s; over gRPC by repetition 0.96x, 0.96x, 0.96x (median 0.96x), "
            "the route's own cost") in section
    # a run without them (kept from before) shows neither line
    old = "\n".join(request_path_section({"rows": run_rows(), "default_configuration": DEFAULT}))
    assert "plain HTTP client minus" not in old and "sent in turn on the same texts" not in old


def test_the_page_says_what_the_sdk_leaves_the_gateway_under_the_bounds():
    from nexus_sli.bench.report import request_path_section

    def section(**kwargs):
        return "\n".join(request_path_section({"rows": run_rows(**kwargs), "default_configuration": DEFAULT}))

    # gRPC 5.0-5.2 ms; through the SDK 6.2-6.5 ms: within the 1.5 ms bound, nothing to say
    within = section(plain_p50=(5.6, 5.8, 5.6))
    assert "leaves the route" not in within and "out of the gateway's reach" not in within
    # through the SDK 7.2-7.5 ms, plain HTTP 6.0-6.2 ms: the SDK's 1.2 ms (median) leaves the route 0.3 ms
    over = section(gateway_p50=(7.2, 7.5, 7.3), plain_p50=(6.0, 6.2, 6.1))
    assert "the SDK's share leaves the route 0.30 ms over gRPC; its own cost was 1.00 ms" in over
    # the SDK's share alone over the bound: out of the gateway's reach
    alone = section(gateway_p50=(7.2, 7.5, 7.3), plain_p50=(5.4, 5.6, 5.5))
    assert "The SDK's share alone is over the 1.5 ms the bound allows" in alone
    # batches: the route meets 0.95x from plain HTTP (0.96x) and misses it through the SDK (0.8x)
    batches = section(paired=((200, 216, 208), (250, 270, 260)), plain_paired=(240, 259.2, 249.6))
    assert "the route meets the bound's 0.95x from plain HTTP and misses it through the SDK" in batches
    # from plain HTTP under the bound too (0.9x): the SDK is not all that misses it
    both = section(paired=((200, 216, 208), (250, 270, 260)), plain_paired=(225, 243, 234))
    assert "meets the bound's" not in both
