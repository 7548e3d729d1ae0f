"""Graphs past ONNX's 2 GB protobuf limit: the graph and its external data file, from export to serving.

A 2 GB model is too slow for ``make test``; the threshold past which a graph
keeps its weights in a data file (:data:`onnx_files.EXTERNAL_DATA_THRESHOLD`)
is lowered instead, so a tiny seeded XLM-R takes the very path
xlm-roberta-large takes (``tests/large_model.py`` runs that one): the torch
export gathered into one data file, the pooling and padding trim added without
loading the weights, ONNX Runtime's fusion and int8 quantization, the fp16
conversion, validation, the repository's ``model.onnx`` + ``model.onnx.data``,
``nexus-sli validate`` and the real Triton server reading both from the version
folder.  Then the pipeline's timing in heats, which keeps a large model's
candidates from all being open at once.
"""

from __future__ import annotations

import shutil
import weakref

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from nexus_sli.client import EncoderClient
from nexus_sli.exporter.export import export_report, onnx_files, pipeline, timing
from nexus_sli.exporter.export.pipeline import ExportOptions, run_export
from nexus_sli.exporter.export.revalidate import revalidate
from nexus_sli.exporter.export.validate import validation_texts
from nexus_sli.exporter.serving import server as serve
from nexus_sli.exporter.targets import Target
from nexus_sli.exporter.targets.openvino_cpu import LARGE_MODEL_VARIANT
from nexus_sli.exporter.triton.publish import read_local
from nexus_sli.exporter.triton.python_models.encoding import encode, load_tokenizer
from nexus_sli.bench.served import free_ports
from helpers.servers import end_now
from helpers.tiny_models import quiet_session

#: Past this many bytes of weights a graph gets a data file in these tests: the tiny XLM-R has ~160 kB.
LOW_THRESHOLD = 10_000
ROWS, COLUMNS = 16, 64


# --- onnx_files on a handmade graph -------------------------------------------------------------

@pytest.fixture
def weights():
    rng = np.random.default_rng(0)
    return rng.standard_normal((ROWS, COLUMNS)).astype(np.float32), rng.standard_normal(COLUMNS).astype(np.float32)


def _model(weights) -> onnx.ModelProto:
    """y = x @ W + b, W 4 kB and b 256 bytes: one tensor past ONNX's inline limit (1 kB), one under."""
    w, b = weights
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["xw"]), helper.make_node("Add", ["xw", "b"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", ROWS])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", COLUMNS])],
        [numpy_helper.from_array(w, "W"), numpy_helper.from_array(b, "b")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _answers(path, weights) -> bool:
    x = np.random.default_rng(1).standard_normal((3, ROWS)).astype(np.float32)
    return np.allclose(quiet_session(path).run(None, {"x": x})[0], x @ weights[0] + weights[1], atol=1e-5)


def test_a_small_graph_stays_one_file(tmp_path, weights):
    path = onnx_files.save(_model(weights), tmp_path / "g.onnx")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.onnx"]
    assert onnx_files.data_files(path) == [] and not onnx_files.external(path) and _answers(path, weights)


def test_past_the_threshold_the_weights_go_to_one_data_file_beside_the_graph(tmp_path, weights, monkeypatch):
    monkeypatch.setattr(onnx_files, "EXTERNAL_DATA_THRESHOLD", 1000)
    path = onnx_files.save(_model(weights), tmp_path / "g.onnx")
    data = tmp_path / "g.onnx.data"
    assert onnx_files.data_files(path) == [data] and onnx_files.external(path)
    assert data.stat().st_size == ROWS * COLUMNS * 4  # W outside; b (under 1 kB) inside the graph
    assert path.stat().st_size < data.stat().st_size and _answers(path, weights)
    onnx_files.save(_model(weights), path)  # ONNX appends to an existing data file: saving again must not
    assert data.stat().st_size == ROWS * COLUMNS * 4 and _answers(path, weights)


def _external_source(folder, weights, one_file: bool):
    folder.mkdir()
    model = _model(weights)
    onnx.save_model(model, str(folder / "g.onnx"), save_as_external_data=True, all_tensors_to_one_file=one_file,
                    location="g.onnx.data" if one_file else None, size_threshold=0)
    return folder / "g.onnx"


def test_rewrite_edits_the_graph_and_links_its_data_beside_the_new_one(tmp_path, weights, monkeypatch):
    source = _external_source(tmp_path / "a", weights, one_file=True)
    (tmp_path / "b").mkdir()

    def load_refused(*args, **kwargs):
        raise AssertionError("rewrite loaded the weights")

    monkeypatch.setattr(onnx, "load_external_data_for_model", load_refused)  # what onnx.load calls

    def rename_output(model):
        model.graph.node.append(helper.make_node("Identity", ["y"], ["z"]))
        model.graph.output[0].name = "z"

    target = onnx_files.rewrite(source, tmp_path / "b" / "g.renamed.onnx", rename_output)
    monkeypatch.undo()
    beside = tmp_path / "b" / "g.onnx.data"
    assert onnx_files.data_files(target) == [beside]
    # a copy, not a hard link: ONNX refuses data files with several links, and the source's stays readable
    assert beside.read_bytes() == (tmp_path / "a" / "g.onnx.data").read_bytes() and beside.stat().st_nlink == 1
    onnx.load(str(target)), onnx.load(str(source))
    assert [o.name for o in quiet_session(target).get_outputs()] == ["z"] and _answers(target, weights)


def test_gather_streams_one_file_per_tensor_into_one_data_file(tmp_path, weights):
    source = _external_source(tmp_path / "torch", weights, one_file=False)  # as the torch exporter writes
    assert len(onnx_files.data_files(source)) == 2
    target = onnx_files.gather(source, tmp_path / "model.onnx")
    shutil.rmtree(tmp_path / "torch")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx", "model.onnx.data"]
    assert onnx_files.data_files(target) == [tmp_path / "model.onnx.data"] and _answers(target, weights)


def test_gather_renames_a_data_file_to_the_new_graph_name(tmp_path, weights):
    source = _external_source(tmp_path / "work", weights, one_file=True)
    (tmp_path / "repo").mkdir()
    target = onnx_files.gather(source, tmp_path / "repo" / "model.onnx")
    assert onnx_files.files(target) == [target, tmp_path / "repo" / "model.onnx.data"]
    shutil.rmtree(tmp_path / "work")
    assert _answers(target, weights)


def test_gather_copies_a_one_file_graph_byte_for_byte(tmp_path, weights):
    source = onnx_files.save(_model(weights), tmp_path / "g.onnx")
    target = onnx_files.gather(source, tmp_path / "model.onnx")
    assert target.read_bytes() == source.read_bytes() and not (tmp_path / "model.onnx.data").exists()


# --- a tiny model down the large-model path ------------------------------------------------------

EXPORTS = {  # name -> options: every step that writes a graph
    "ort_fp32": dict(backend="onnxruntime", precision="fp32"),   # plain and fused (the optimizer)
    "ort_int8": dict(backend="onnxruntime", precision="int8"),   # the quantizer
    "ov_fp32": dict(backend="openvino", precision="fp32"),       # OpenVINO reading ONNX + data
}


@pytest.fixture(scope="module")
def large_path(tiny_checkpoint, tmp_path_factory):
    """The tiny XLM-R exported as a graph past the (lowered) threshold, by each target; the GPU export
    (fp16) in a repository of its own, as it asks for a GPU to serve it."""
    out, gpu = tmp_path_factory.mktemp("external"), tmp_path_factory.mktemp("external-gpu")
    model = str(tiny_checkpoint("xlm-roberta"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(onnx_files, "EXTERNAL_DATA_THRESHOLD", LOW_THRESHOLD)
        for name, options in EXPORTS.items():
            run_export(ExportOptions(model=model, name=name, out=out, task="embedding", **options))
        run_export(ExportOptions(model=model, name="gpu", out=gpu, task="embedding", device="gpu", backend="auto",
                                 precision="auto"))
        # NNCF's IR (no 2 GB limit) from the graph with its data file; the tiny model need not keep int8's bar
        run_export(ExportOptions(model=model, name="ov_int8", out=gpu, task="embedding", backend="openvino",
                                 precision="int8", allow_degraded=True))
        # every configuration in one export: each attempt reads the plain graph's data after the others
        run_export(ExportOptions(model=model, name="auto", out=gpu, task="embedding", backend="auto",
                                 precision="auto"))
    return {"repo": out, "gpu": gpu, "model": model}


@pytest.mark.parametrize("name", [*EXPORTS, "gpu"])
def test_the_encoder_version_folder_holds_the_graph_and_its_data_file(large_path, name):
    version = (large_path["gpu"] if name == "gpu" else large_path["repo"]) / f"{name}_encoder" / "1"
    graph, data = version / "model.onnx", version / "model.onnx.data"
    assert sorted(p.name for p in version.iterdir()) == ["model.onnx", "model.onnx.data"]
    assert onnx_files.data_files(graph) == [data]
    tensors = list(onnx_files._tensors(onnx.load(str(graph), load_external_data=False).graph))
    outside = [t for t in tensors if onnx_files.uses_external_data(t)]
    # every tensor of 1 kB or more is in the data file, which holds nothing else
    assert all(_bytes(t) < onnx_files.INLINE_BYTES for t in tensors if t not in outside)
    assert data.stat().st_size == sum(_bytes(t) for t in outside) > LOW_THRESHOLD / 2


def _bytes(tensor) -> int:
    return int(np.prod(tensor.dims)) * helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize


def test_the_graph_cannot_run_without_its_data_file(large_path, tmp_path):
    shutil.copyfile(large_path["repo"] / "ort_fp32_encoder" / "1" / "model.onnx", tmp_path / "model.onnx")
    with pytest.raises(Exception, match="model.onnx.data"):
        quiet_session(tmp_path / "model.onnx")


@pytest.mark.parametrize("name", [*EXPORTS, "gpu", "auto"])
def test_each_validates_again_from_the_repository(large_path, name):
    # nexus-sli validate: ONNX Runtime (CPU, and the fp16 graph) or OpenVINO opens model.onnx in the version
    # folder and must find model.onnx.data beside it
    record = revalidate(large_path["repo" if name in EXPORTS else "gpu"], name)
    assert record["passed"] and record["texts"] == len(validation_texts())


def test_a_large_model_gets_one_nncf_variant_and_the_report_says_why(large_path):
    exported = export_report.read(large_path["gpu"] / "ov_int8_encoder")
    assert exported.large_model is True
    assert [c.graph for c in exported.candidates] == [LARGE_MODEL_VARIANT]
    assert "one NNCF variant" in exported.attempts[0].left_out
    assert sorted(p.name for p in (large_path["gpu"] / "ov_int8_encoder" / "1").iterdir()) == ["model.bin", "model.xml"]
    # held to the auto bar, ONNX Runtime's int8 keeps its dynamic variants and leaves NNCF's static one out
    auto = export_report.read(large_path["gpu"] / "auto_encoder")
    (ort_int8,) = [a for a in auto.attempts if (a.backend, a.precision) == ("onnxruntime", "int8")]
    assert "no NNCF static one" in ort_int8.left_out
    assert not [r for r in auto.measured if "static" in r.graph]


def test_publishing_uploads_the_data_file(large_path):
    files = read_local(large_path["repo"])["ov_fp32_encoder"].files
    assert set(files) == {"model.onnx", "model.onnx.data"}


def _pytorch_embeddings(checkpoint: str, texts: list[str], repo, name: str) -> np.ndarray:
    """What the served ensemble should answer: PyTorch's token states for the texts tokenized as the served
    tokenizer does, mean-pooled and normalised."""
    from transformers import AutoModel

    exported = export_report.read(repo / f"{name}_encoder")
    tokenizer = load_tokenizer(repo / f"{name}_tokenizer" / "1" / "tokenizer.json", exported.max_length)
    feeds = {k: torch.from_numpy(v) for k, v in encode(tokenizer, texts, exported.inputs, 1,
                                                       exported.max_length).items()}
    with torch.no_grad():
        states = AutoModel.from_pretrained(checkpoint).eval()(**feeds).last_hidden_state
    mask = feeds["attention_mask"][..., None]
    return torch.nn.functional.normalize((states * mask).sum(1) / mask.sum(1), dim=-1).numpy()


def test_the_triton_server_serves_each_from_its_version_folder(large_path):
    repo = large_path["repo"]
    texts = validation_texts()[:5]
    expected = _pytorch_embeddings(large_path["model"], texts, repo, "ort_fp32")
    http, grpc, metrics = free_ports(3)
    process = serve.start(repo, http, grpc, metrics)
    try:
        with EncoderClient(f"127.0.0.1:{grpc}") as client:
            served = {name: np.asarray(client.embed(texts, model=name)) for name in EXPORTS}
    finally:
        end_now(process)
    for name, vectors in served.items():
        cosines = np.sum(vectors * expected, axis=1)
        # fp32 at parity; int8 within its own bar (docs/export.md, "Validation")
        assert cosines.min() > (0.95 if name == "ort_int8" else 0.9999), (name, cosines)


# --- timing in heats: a large model's candidates are never all open at once ----------------------

@pytest.fixture
def open_runners(monkeypatch):
    """How many runners (validation's and timing's) were alive at most at one time."""
    alive, peak = set(), [0]
    original = Target.runner

    def runner(self, candidate, precision):
        opened = original(self, candidate, precision)
        token = object()
        alive.add(token)
        peak[0] = max(peak[0], len(alive))
        weakref.finalize(opened, alive.discard, token)
        return opened

    monkeypatch.setattr(Target, "runner", runner)
    return peak


def test_graphs_that_do_not_fit_in_memory_together_are_timed_in_heats(tiny_checkpoint, tmp_path, monkeypatch,
                                                                      open_runners):
    monkeypatch.setattr(pipeline, "memory_budget", lambda: 1)  # nothing fits: heats of two
    result = run_export(ExportOptions(model=str(tiny_checkpoint("bert")), name="heats", out=tmp_path,
                                      task="embedding", backend="auto", precision="fp32"))
    timing, rows = result.report.timing, result.report.measured
    passed = [f"{r.backend} {r.precision} {r.graph}" for r in rows if r.passed]
    assert len(passed) >= 3 and open_runners[0] == 2 and result.report.large_model is False
    heats = [heat.score for heat in timing.heats]
    assert [len(heat) for heat in heats] == [2] * (len(passed) - 1)
    assert {label for heat in heats for label in heat} == set(passed)
    for heat, following in zip(timing.heats, timing.heats[1:]):
        assert heat.fastest == min(heat.score, key=heat.score.get)
        assert heat.fastest in following.score  # the fastest of each heat runs in the next
    chosen = next(f"{r.backend} {r.precision} {r.graph}" for r in rows if r.chosen)
    assert chosen == timing.heats[-1].fastest == min(heats[-1], key=heats[-1].get)


def test_graphs_that_fit_are_timed_in_one_heat_and_validation_holds_one_open_at_a_time(tiny_checkpoint, tmp_path,
                                                                                        open_runners):
    result = run_export(ExportOptions(model=str(tiny_checkpoint("bert")), name="one", out=tmp_path,
                                      task="embedding", backend="auto", precision="fp32"))
    passed = [r for r in result.report.measured if r.passed]
    heats = result.report.timing.heats
    assert len(heats) == 1 and len(heats[0].score) == len(passed)
    assert open_runners[0] == len(passed)  # validation opened one at a time; timing all passing ones together
    assert export_report.read(tmp_path / "one_encoder").timing == result.report.timing


class _FakeRunner:
    """A graph whose every run 'takes' ``ms`` milliseconds (timing.run_ms is patched to read it), or the
    ``spikes`` milliseconds given for its runs by number (warm-ups counted)."""

    def __init__(self, ms: float, spikes: dict[int, float] | None = None):
        self.ms, self.runs, self.spikes = ms, 0, spikes or {}

    def run(self, outputs, feeds):
        self.runs += 1

    def took(self) -> float:
        return self.spikes.get(self.runs, self.ms)


def _fake_run_ms(runner, feeds):
    runner.run(None, feeds)
    return runner.took()


@pytest.mark.real_timing
@pytest.mark.parametrize("ms, rounds", [(5.0, timing.ROUNDS), (30_000.0, timing.LONG_ROUNDS)])
def test_heats_carry_the_fastest_forward_and_long_runs_take_fewer_rounds(monkeypatch, ms, rounds):
    monkeypatch.setattr(timing, "run_ms", _fake_run_ms)
    # graph 2 is the fastest; none far enough behind another to stop being timed (timing.LEFT_BEHIND)
    speeds = [ms * 1.3, ms * 1.2, ms, ms * 1.4]
    opened: list[int] = []
    runners: dict[int, _FakeRunner] = {}

    def open_graph(index):
        opened.append(index)
        runners[index] = _FakeRunner(speeds[index])
        return runners[index]

    load = timing.Workload("batch", {"input_ids": np.zeros((1, 4), np.int64)})
    heats = timing.time_in_heats(open_graph, [3, 3, 3, 3], [load], budget=7)
    assert [sorted(heat) for heat in heats.heats] == [[0, 1], [1, 2], [2, 3]] and heats.rounds == [rounds] * 3
    assert heats.fastest == 2 and heats.heats[-1] == pytest.approx({2: 1.0, 3: 1.4})  # ratios to the heat's best
    assert heats.left == [{}, {}, {}]
    assert opened == [0, 1, 2, 3]  # the leader stays open into the next heat, never reopened
    assert [heats.timings[i]["batch"] for i in range(4)] == speeds
    per_heat = timing.WARMUP + rounds if rounds == timing.ROUNDS else 1 + rounds  # warm-ups, then rounds
    assert runners[0].runs == per_heat and runners[1].runs == 2 * per_heat and runners[3].runs == per_heat


def _race(monkeypatch, runners: list[_FakeRunner], objective: str = "balanced") -> timing.Heats:
    monkeypatch.setattr(timing, "run_ms", _fake_run_ms)
    loads = [timing.Workload("batch of 32", {}, "batch"), timing.Workload("one short text", {}, "single")]
    return timing.time_in_heats(lambda i: runners[i], [1] * len(runners), loads, budget=10, objective=objective)


@pytest.mark.real_timing
def test_a_graph_far_behind_stops_being_timed_and_the_race_ends_with_one_left(monkeypatch):
    # graph 0 is 3x slower than graph 1 on every run; graph 2 is 1.2x slower than graph 1: it stays in the race
    runners = [_FakeRunner(30.0), _FakeRunner(10.0), _FakeRunner(12.0)]
    heats = _race(monkeypatch, runners)
    assert heats.fastest == 1 and heats.left == [{0: timing.ROUNDS_BEFORE_LEAVING}]
    assert heats.heats[0][0] >= timing.LEFT_BEHIND  # a graph left behind scores at least that far from the best
    loads = 2  # each round runs every graph still racing on both workloads
    assert runners[0].runs == loads * (timing.WARMUP + timing.ROUNDS_BEFORE_LEAVING)
    assert runners[1].runs == runners[2].runs == loads * (timing.WARMUP + timing.ROUNDS)
    # where the last other graph leaves, the race is over: the fastest runs no further rounds either
    runners = [_FakeRunner(30.0), _FakeRunner(10.0)]
    heats = _race(monkeypatch, runners)
    assert heats.fastest == 1 and heats.left == [{0: timing.ROUNDS_BEFORE_LEAVING}]
    assert runners[0].runs == runners[1].runs == loads * (timing.WARMUP + timing.ROUNDS_BEFORE_LEAVING)
    assert heats.timings[1] == {"batch of 32": 10.0, "one short text": 10.0}


@pytest.mark.real_timing
def test_one_slow_run_leaves_no_graph_behind(monkeypatch):
    # graph 0's first timed batch takes 10x its usual time (run 5: two warm-ups on each of two workloads
    # first); at its fastest it is still level with graph 1
    runners = [_FakeRunner(10.0, spikes={5: 100.0}), _FakeRunner(10.0)]
    heats = _race(monkeypatch, runners)
    assert heats.left == [{}] and runners[0].runs == runners[1].runs == 2 * (timing.WARMUP + timing.ROUNDS)
    # a graph slower on the batch only, under the latency objective (the lone query alone counts), stays
    runners = [_FakeRunner(10.0, spikes={n: 40.0 for n in range(1, 20, 2)}), _FakeRunner(10.0)]
    assert _race(monkeypatch, runners, objective="latency").left == [{}]
    assert _race(monkeypatch, [_FakeRunner(10.0, spikes={n: 40.0 for n in range(1, 20, 2)}), _FakeRunner(10.0)],
                 objective="throughput").left == [{0: timing.ROUNDS_BEFORE_LEAVING}]


def test_the_objective_weighs_batch_and_lone_query_as_ratios_to_the_best():
    batch = timing.Workload("batch of 32", {}, "batch")
    single = timing.Workload("one short text", {}, "single")
    # the case the score was made for (bench/data/tried.md, "Timing score"): a graph a little faster on the
    # batch and much slower alone
    measured = {0: {"batch of 32": 667.7, "one short text": 6.5}, 1: {"batch of 32": 677.1, "one short text": 3.6}}
    by = {objective: timing.scores(measured, [batch, single], objective) for objective in timing.OBJECTIVES}
    assert min(by["throughput"], key=by["throughput"].get) == 0 and by["throughput"][0] == 1.0
    assert min(by["latency"], key=by["latency"].get) == 1 and by["latency"][0] == pytest.approx(6.5 / 3.6)
    assert min(by["balanced"], key=by["balanced"].get) == 1
    assert by["balanced"][0] == pytest.approx((6.5 / 3.6) ** 0.5) and by["balanced"][1] == pytest.approx(
        (677.1 / 667.7) ** 0.5)
    with pytest.raises(ValueError, match="unknown objective 'fast'; known: balanced, throughput, latency"):
        timing.scores(measured, [batch, single], "fast")
