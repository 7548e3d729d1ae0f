"""The tokenizer inside the exported graph: same token ids as the model's tokenizer? cheaper per query?

An experiment, not part of the product or of ``make bench`` (no test runs it); its findings are in
bench/data/tried.md, "The tokenizer inside the graph".  Four steps, each in its own environment,
run from the repository root:

1. ``prepare`` (the project's venv): the texts (the export's 240 validation texts, awkward texts,
   the bench's first 100 short queries), the model's tokenizer files and limits, the encoder graphs
   of an exported repository and the CPU's instruction sets, into ``WORK/setup.json``::

       .venv/bin/python bench/experiments/ingraph_tokenizer.py prepare /tmp/ingraph \\
           --repository bench/.repo [--onnx all_minilm_l6_v2_encoder] [--openvino all_minilm_l6_v2_ov_int8_encoder]

   The repository is the bench's own (``nexus-sli bench --export-only``), which holds the ONNX
   Runtime fp32 export and the OpenVINO int8 export ``auto`` keeps on a CPU with VNNI.

2. ``onnxruntime`` (a scratch venv: ``onnxruntime`` at the project's version, ``onnxruntime-extensions``,
   ``onnx``, ``tokenizers``, ``numpy``, and ``transformers`` without torch, which the converter reads
   the tokenizer through)::

       python -m venv /tmp/venv-ortx
       /tmp/venv-ortx/bin/pip install onnxruntime==1.32.0 onnxruntime-extensions onnx==1.23.2 \\
           tokenizers==0.23.3 numpy==1.26.4 transformers==5.24.0
       HF_HUB_OFFLINE=1 /tmp/venv-ortx/bin/python bench/experiments/ingraph_tokenizer.py onnxruntime /tmp/ingraph

3. ``openvino`` (a scratch venv: ``openvino-tokenizers`` and the ``openvino`` it pins, at the project's
   version, ``tokenizers``, ``numpy``, ``transformers`` without torch)::

       python -m venv /tmp/venv-ovtok
       /tmp/venv-ovtok/bin/pip install openvino-tokenizers~=2026.4.1 tokenizers==0.23.3 numpy==1.26.4 \\
           transformers==5.24.0
       HF_HUB_OFFLINE=1 /tmp/venv-ovtok/bin/python bench/experiments/ingraph_tokenizer.py openvino /tmp/ingraph

4. ``served`` (the project's venv, after steps 2 and 3, which save their one graphs into WORK):
   ``nexus-sli serve`` on a copy of the repository's two ensembles (tokenizer step, then the encoder)
   beside four python models that take the text and answer EMBEDDING in one step: the one graph
   (``one_graph_*``: the tokenizer inside the graph, the library's extension loaded), and as the
   control the tokenizer step's own code followed by the plain encoder graph (``one_step_*``);
   single short queries over gRPC::

       .venv/bin/python bench/experiments/ingraph_tokenizer.py served /tmp/ingraph --repository bench/.repo

Steps 2 to 4 print the id checks and the timings as markdown tables and write them to
``WORK/<step>.json``.  ``--rounds`` sets the interleaved rounds (default 10).  The scratch steps
import the served tokenizer's own ``encoding.py`` (numpy and tokenizers only), so path (a) is the
tokenizer step's code: ``encode_batch``, then ``to_arrays`` at the tokenizer step's pad width
(what the tokenizer step answers) or at the longest row (what the encoder shim runs after its cut).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "exporter" / "triton" / "python_models"))

from encoding import encode, load_tokenizer, to_arrays  # noqa: E402

INPUTS = ("input_ids", "attention_mask", "token_type_ids")
#: the variants both runtimes time, and what each in-graph one is paired with
PADDED, LONGEST = "tokenize: tokenizers + numpy, pad width", "tokenize: tokenizers + numpy, longest"
TWO_STEPS, ONE_GRAPH = "query: tokenizers + numpy, then the encoder graph", "query: one graph, string in"
SHORT_QUERIES = 100
#: texts that tokenizers handle by rules a converted tokenizer may not copy
AWKWARD = [
    "", " ", "   \t\n  ",
    "Café résumé naïve façade jalapeño Ångström Øresund",
    "ÀÉÎÕÜ àéîõü ÇÑ ß ﬁ ligature",
    "e\u0301 combining acute, n\u0303 combining tilde",
    "東京は日本の首都です。北京是中国的首都。",
    "서울은 한국의 수도입니다",
    "กรุงเทพมหานครเป็นเมืองหลวงของประเทศไทย",
    "القاهرة هي عاصمة مصر",
    "Москва — столица России",
    "emoji 😀🚀👍🏽 and family 👨‍👩‍👧 flags 🇫🇷🇯🇵",
    "zero\u200bwidth\u200dspace and soft\u00adhyphen",
    "control\x00chars\x07and\x1btabs\tnewline\nend",
    "[CLS] [SEP] [MASK] [PAD] [UNK] literal special tokens",
    "URLs https://example.com/a?b=c&d=e#f and e-mails someone@example.org",
    "!!!???... ---- ((([[[{{{}}}]]]))) $$$ %%% ^^^",
    "numbers 3.14159 1,000,000 1999-12-31 12:34:56 0x1F",
    "MiXeD CaSe WORDS and Title Case",
    "a" * 300,
    "supercalifragilisticexpialidocious pneumonoultramicroscopicsilicovolcanoconiosis",
    " ".join(["the quick brown fox jumps over the lazy dog"] * 80),
    "café " * 400,
    "東京 " * 600,
]


# ---------------------------------------------------------------- prepare (the project's venv)

def prepare(args) -> None:
    from nexus_sli.bench.cpu_classes import cpu_class
    from nexus_sli.bench.machine import machine_info
    from nexus_sli.bench.prepare import SHORT_QUERY_TOKENS, short_queries
    from nexus_sli.bench.texts import bench_texts
    from nexus_sli.exporter.export.source import resolve_model
    from nexus_sli.exporter.export.validate import validation_texts

    source = resolve_model(args.model)
    repository = Path(args.repository).resolve()
    params = _tokenizer_params(repository / args.tokenizer / "config.pbtxt")
    tokenizer = load_tokenizer(str(source.path / "tokenizer.json"), int(params["max_length"]))
    texts = bench_texts()
    tokens = [len(e.ids) for e in tokenizer.encode_batch(texts)]
    machine = machine_info()
    setup = {
        "model": source.model_id, "model_dir": str(source.path),
        "max_length": int(params["max_length"]), "pad_id": int(params["pad_id"]),
        "pad_width": int(params.get("pad_widths", params["max_length"]).split(",")[-1]),
        "onnx": str(repository / args.onnx / "1" / "model.onnx"),
        "openvino": str(repository / args.openvino / "1" / "model.xml"),
        "validation": validation_texts(), "awkward": AWKWARD,
        "short": short_queries(texts, tokens, SHORT_QUERIES), "short_tokens": SHORT_QUERY_TOKENS,
        "cpu": machine["cpu_model"], "cores": machine["usable_cores"],
        "isa": sorted(flag for flag, present in machine["flags"].items() if present),
        "cpu_class": cpu_class(machine["flags"]),
    }
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    (work / "setup.json").write_text(json.dumps(setup, indent=1, ensure_ascii=False))
    print(f"{work / 'setup.json'}: {len(setup['validation'])} validation texts, {len(setup['short'])} short "
          f"queries; {setup['cpu']} ({setup['cpu_class']}: {', '.join(setup['isa'])})")


def _tokenizer_params(config: Path) -> dict[str, str]:
    """The tokenizer step's parameters, read from its config.pbtxt's key/string_value pairs."""
    params, key = {}, None
    for line in config.read_text().splitlines():
        line = line.strip()
        if line.startswith("key:"):
            key = json.loads(line.split(":", 1)[1])
        elif line.startswith("string_value:") and key is not None:
            params[key], key = json.loads(line.split(":", 1)[1]), None
    return params


# ---------------------------------------------------------------- what both runtimes share

class Reference:
    """The tokenizer step's tokenizer (``encoding.load_tokenizer``) and its arrays."""

    def __init__(self, setup: dict):
        self.setup = setup
        self.tokenizer = load_tokenizer(str(Path(setup["model_dir"]) / "tokenizer.json"), setup["max_length"])

    def served(self, text: str) -> dict[str, np.ndarray]:
        """What the tokenizer step answers for one text: padded to its pad width."""
        return to_arrays(self.tokenizer.encode_batch([text]), list(INPUTS), self.setup["pad_id"],
                         self.setup["pad_width"])

    def trimmed(self, text: str) -> dict[str, np.ndarray]:
        """What the encoder runs: padded to the longest row (the encoder's cut, or ``encode``)."""
        return encode(self.tokenizer, [text], list(INPUTS), self.setup["pad_id"], self.setup["max_length"])


def check_ids(reference: Reference, tokenize, texts: list[str], label: str) -> dict:
    """Each text alone: the graph's ids, mask and type ids against tokenizers', row cut to its mask."""
    mismatches = []
    for index, text in enumerate(texts):
        want = reference.trimmed(text)
        try:
            got = tokenize(text)
        except Exception as exc:  # noqa: BLE001 - a converted tokenizer's refusal is a finding
            mismatches.append({"index": index, "text": text[:80], "error": f"{type(exc).__name__}: {exc}"[:300]})
            continue
        same = all(np.array_equal(np.asarray(got[name]).reshape(1, -1), want[name]) for name in INPUTS)
        if not same:
            mismatches.append({"index": index, "text": text[:80], "tokens": int(want["input_ids"].shape[1]),
                               "want": want["input_ids"][0].tolist()[:24],
                               "got": np.asarray(got["input_ids"]).reshape(-1).tolist()[:24],
                               "got_tokens": int(np.asarray(got["input_ids"]).size)})
    return {"set": label, "texts": len(texts), "mismatches": len(mismatches), "examples": mismatches}


def check_batches(reference: Reference, tokenize_batch, texts: list[str], size: int = 16) -> dict:
    """Batches of ``size`` texts padded to their longest: every array equal to ``encoding.encode``'s."""
    wrong = 0
    for start in range(0, len(texts), size):
        batch = texts[start:start + size]
        want = encode(reference.tokenizer, batch, list(INPUTS), reference.setup["pad_id"],
                      reference.setup["max_length"])
        got = tokenize_batch(batch)
        wrong += sum(not np.array_equal(np.asarray(got[name]), want[name]) for name in INPUTS)
    return {"set": f"validation, batches of {size}", "texts": len(texts), "arrays_differing": wrong}


def interleave(variants: dict, queries: list[str], rounds: int) -> dict:
    """Every variant on each query in turn (the order rotated from query to query), so that a
    neighbour's load falls on all of them alike; per round (all the queries once), the p50 and
    p99 of each variant's per-query times (ms)."""
    names = list(variants)
    for text in queries:  # warm: every shape the queries will have
        for name in names:
            variants[name](text)
    per_round = {name: [] for name in names}
    for _ in range(rounds):
        times = {name: [] for name in names}
        for index, text in enumerate(queries):
            shift = index % len(names)
            for name in names[shift:] + names[:shift]:
                start = time.perf_counter()
                variants[name](text)
                times[name].append((time.perf_counter() - start) * 1e3)
        for name in names:
            per_round[name].append((float(np.percentile(times[name], 50)), float(np.percentile(times[name], 99))))
    return per_round


def summarize(per_round: dict, pairs: list[tuple[str, str]]) -> dict:
    rows = {name: {"p50_ms": statistics.median(p50 for p50, _ in rounds),
                   "p99_ms": statistics.median(p99 for _, p99 in rounds),
                   "p50_spread_ms": [min(p50 for p50, _ in rounds), max(p50 for p50, _ in rounds)]}
            for name, rounds in per_round.items()}
    ratios = {}
    for new, old in pairs:
        paired = [a[0] / b[0] for a, b in zip(per_round[new], per_round[old])]
        diffs = [a[0] - b[0] for a, b in zip(per_round[new], per_round[old])]
        ratios[f"{new} / {old}"] = {"median_ratio": statistics.median(paired),
                                    "median_diff_ms": statistics.median(diffs),
                                    "lower_in": sum(r < 1 for r in paired), "rounds": len(paired)}
    return {"rows": rows, "paired": ratios}


def timed(variants: dict, queries: list[str], rounds: int, pairs: list[tuple[str, str]]) -> dict:
    """The tokenize variants interleaved among themselves, then the query variants: a tokenize
    call right after an encoder run would pay for the caches the encoder evicted."""
    timing = {"rows": {}, "paired": {}}
    for prefix in ("tokenize:", "query:"):
        group = {name: run for name, run in variants.items() if name.startswith(prefix)}
        found = summarize(interleave(group, queries, rounds), [pair for pair in pairs if pair[0].startswith(prefix)])
        timing["rows"].update(found["rows"])
        timing["paired"].update(found["paired"])
    return timing


def print_timing(timing: dict, what: str) -> None:
    print(f"| {what} | p50 ms | p99 ms | rounds' p50 min-max |\n|---|---:|---:|---:|")
    for name, row in timing["rows"].items():
        low, high = row["p50_spread_ms"]
        print(f"| {name} | {row['p50_ms']:.3f} | {row['p99_ms']:.3f} | {low:.3f}-{high:.3f} |")
    print("\n| paired, round by round | median ratio | median difference ms | lower in |\n|---|---:|---:|---:|")
    for name, pair in timing["paired"].items():
        print(f"| {name} | {pair['median_ratio']:.3f}x | {pair['median_diff_ms']:+.3f} | "
              f"{pair['lower_in']}/{pair['rounds']} |")


def report(setup: dict, runtime: str, found: dict, work: Path) -> None:
    print(f"\n## {runtime}: {setup['model']} on {setup['cpu']} ({setup['cores']} cores; {setup['cpu_class']}: "
          f"{', '.join(setup['isa'])})")
    for name, checks in found["checks"].items():
        print(f"\n### ids: {name}\n\n| set | texts | mismatches |\n|---|---:|---:|")
        for check in checks:
            count = check.get("mismatches", check.get("arrays_differing"))
            print(f"| {check['set']} | {check['texts']} | {count} |")
        for check in checks:
            for example in check.get("examples", [])[:6]:
                print(f"- {check['set']} #{example['index']} {example['text']!r}: "
                      + (example["error"] if "error" in example else
                         f"want {example['tokens']} tokens {example['want'][:12]}, "
                         f"got {example['got_tokens']} {example['got'][:12]}"))
    print(f"\n### cost per short query, {found['rounds']} interleaved rounds, median over rounds (ms)\n")
    print_timing(found["timing"], "variant")
    (work / f"{runtime}.json").write_text(json.dumps({"setup": {k: setup[k] for k in (
        "model", "cpu", "cores", "isa", "cpu_class")}, **found}, indent=1, ensure_ascii=False))


def hf_tokenizer(setup: dict):
    """The model's tokenizer as transformers reads it from the local folder (the converters take only this)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(setup["model_dir"], local_files_only=True)


def id_checks(reference: Reference, setup: dict, tokenize) -> list[dict]:
    return [check_ids(reference, tokenize, setup["validation"], "validation"),
            check_ids(reference, tokenize, setup["awkward"], "awkward"),
            check_ids(reference, tokenize, setup["short"], "short queries")]


# ---------------------------------------------------------------- ONNX Runtime with onnxruntime-extensions

def onnxruntime_step(args) -> None:
    import onnx
    import onnxruntime as ort
    from onnxruntime_extensions import gen_processing_models, get_library_path

    setup = json.loads((Path(args.work) / "setup.json").read_text())
    reference = Reference(setup)
    hf = hf_tokenizer(setup)
    options = ort.SessionOptions()
    # the served encoder's settings (the onnxruntime backend shim's defaults): a thread per core, no spinning
    options.intra_op_num_threads = 0
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.register_custom_ops_library(get_library_path())
    converted = {
        "as converted": gen_processing_models(hf, pre_kwargs={"max_length": setup["max_length"]})[0],
        # the BERT normalizer strips accents when it lowercases unless told otherwise; the converter
        # reads only an explicit strip_accents
        "strip_accents=1": gen_processing_models(hf, pre_kwargs={"max_length": setup["max_length"],
                                                                 "strip_accents": 1})[0],
    }
    checks, sessions = {}, {}
    for name, graph in converted.items():
        sessions[name] = ort.InferenceSession(graph.SerializeToString(), options)
        checks[f"onnxruntime-extensions BertTokenizer, {name}"] = id_checks(
            reference, setup, _ortx_tokenize(sessions[name]))
    fixed = sessions["strip_accents=1"]
    one_graph = _merged_onnx(converted["strip_accents=1"], setup["onnx"])  # edits the tokenizer graph in place
    onnx.save(one_graph, str(Path(args.work) / "one_graph_onnxruntime.onnx"))
    (Path(args.work) / "one_graph_onnxruntime.extension").write_text(get_library_path())
    merged = ort.InferenceSession(one_graph.SerializeToString(), options)
    encoder = ort.InferenceSession(setup["onnx"], options)
    checks["one graph's EMBEDDING against tokenizers + the encoder (texts over 1e-5)"] = _embedding_checks(
        lambda t: merged.run(["EMBEDDING"], {"text": np.array([t], dtype=object)})[0],
        lambda t: encoder.run(["EMBEDDING"], reference.trimmed(t))[0], setup)
    variants = {
        PADDED: reference.served,
        LONGEST: reference.trimmed,
        "tokenize: in graph (BertTokenizer op)": lambda t: fixed.run(None, {"text": np.array([t], dtype=object)}),
        TWO_STEPS: lambda t: encoder.run(["EMBEDDING"], reference.trimmed(t)),
        ONE_GRAPH: lambda t: merged.run(["EMBEDDING"], {"text": np.array([t], dtype=object)}),
    }
    ours = "tokenize: in graph (BertTokenizer op)"
    timing = timed(variants, setup["short"], args.rounds, [(ours, LONGEST), (ours, PADDED), (ONE_GRAPH, TWO_STEPS)])
    report(setup, "onnxruntime", {"checks": checks, "timing": timing, "rounds": args.rounds,
                                  "versions": {"onnxruntime": ort.__version__}}, Path(args.work))


def _ortx_tokenize(session):
    def tokenize(text):
        ids, types, mask, _ = session.run(None, {"text": np.array([text], dtype=object)})
        return {"input_ids": ids, "token_type_ids": types, "attention_mask": mask}
    return tokenize


def _merged_onnx(tokenizer_graph, encoder_path: str):
    """The BertTokenizer op's 1-D outputs made a batch of one and fed to the encoder: EMBEDDING out.
    (The op reads a second string as the second text of a pair, so the graph takes one text.)"""
    import onnx
    from onnx import compose, helper

    encoder = onnx.load(encoder_path)
    graph = tokenizer_graph.graph
    axes = helper.make_tensor("batch_axis", onnx.TensorProto.INT64, [1], [0])
    graph.initializer.append(axes)
    outputs = []
    for name in INPUTS:
        flat = f"{name}_flat"
        for node in graph.node:
            node.output[:] = [flat if out == name else out for out in node.output]
        graph.node.append(helper.make_node("Unsqueeze", [flat, "batch_axis"], [name]))
        outputs.append(helper.make_tensor_value_info(name, onnx.TensorProto.INT64, [1, None]))
    del graph.output[:]
    graph.output.extend(outputs)
    encoder_opset = {o.domain: o.version for o in encoder.opset_import}
    for opset in tokenizer_graph.opset_import:
        if opset.domain in ("", "ai.onnx"):
            opset.version = encoder_opset.get("", opset.version)
    tokenizer_graph.ir_version = encoder.ir_version
    known = {o.domain for o in tokenizer_graph.opset_import}
    tokenizer_graph.opset_import.extend(o for o in encoder.opset_import if o.domain not in known)
    return compose.merge_models(tokenizer_graph, encoder, io_map=[(n, n) for n in INPUTS],
                                outputs=["EMBEDDING"])


def _embedding_checks(one_graph, two_steps, setup: dict) -> list[dict]:
    """EMBEDDING from the one graph against tokenizers + the encoder graph, per text set."""
    checks = []
    for label in ("validation", "awkward", "short"):
        texts = setup[label]
        differences = [float(np.abs(np.asarray(one_graph(t)).reshape(-1) - np.asarray(two_steps(t)).reshape(-1)).max())
                       for t in texts]
        checks.append({"set": f"{label}: largest |difference| {max(differences):.2e}", "texts": len(texts),
                       "mismatches": sum(d > 1e-5 for d in differences)})
    return checks


# ---------------------------------------------------------------- OpenVINO with openvino-tokenizers

def openvino_step(args) -> None:
    import openvino as ov
    from openvino_tokenizers import convert_tokenizer

    setup = json.loads((Path(args.work) / "setup.json").read_text())
    reference = Reference(setup)
    core = ov.Core()
    # the served encoder's properties (openvino_properties.compile_properties for an int8 export)
    properties = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_PRECISION_HINT": "f32"}
    tokenizer_model = convert_tokenizer(hf_tokenizer(setup), max_length=setup["max_length"], truncation=True)
    tokenizer = core.compile_model(tokenizer_model, "CPU", properties)
    # strings are tokenized on one thread whatever the hint; a second thread only adds its wake-up
    single = core.compile_model(tokenizer_model, "CPU", {**properties, "INFERENCE_NUM_THREADS": 1})

    def tokenize(texts):
        results = tokenizer(np.array(texts))
        return {port.get_any_name(): results[port] for port in tokenizer.outputs}

    encoder = core.compile_model(core.read_model(setup["openvino"]), "CPU", properties)
    request = encoder.create_infer_request()
    embedding = next(port for port in encoder.outputs if port.get_any_name() == "EMBEDDING")
    merged_model = _merged_openvino(convert_tokenizer(hf_tokenizer(setup), max_length=setup["max_length"],
                                                      truncation=True), core.read_model(setup["openvino"]))
    merged = core.compile_model(merged_model, "CPU", properties)
    ov.save_model(merged_model, str(Path(args.work) / "one_graph_openvino.xml"), compress_to_fp16=False)
    import openvino_tokenizers
    (Path(args.work) / "one_graph_openvino.extension").write_text(str(openvino_tokenizers._ext_path))
    merged_request = merged.create_infer_request()
    merged_embedding = next(port for port in merged.outputs if port.get_any_name() == "EMBEDDING")

    def one_graph(text):
        return merged_request.infer([np.array([text])])[merged_embedding].copy()

    def two_steps(text):
        return request.infer(reference.trimmed(text))[embedding].copy()

    checks = {"openvino-tokenizers convert_tokenizer": [
        *id_checks(reference, setup, lambda text: tokenize([text])),
        check_batches(reference, tokenize, setup["validation"])],
        "one graph's EMBEDDING against tokenizers + the encoder (texts over 1e-5)": _embedding_checks(
            one_graph, two_steps, setup)}
    variants = {
        PADDED: reference.served,
        LONGEST: reference.trimmed,
        "tokenize: in graph (openvino-tokenizers)": lambda t: tokenize([t]),
        "tokenize: in graph (openvino-tokenizers), 1 thread": lambda t: single(np.array([t])),
        TWO_STEPS: two_steps,
        ONE_GRAPH: one_graph,
    }
    ours = "tokenize: in graph (openvino-tokenizers)"
    timing = timed(variants, setup["short"], args.rounds, [(ours, LONGEST), (ours, PADDED),
                                                           (f"{ours}, 1 thread", LONGEST), (ONE_GRAPH, TWO_STEPS)])
    report(setup, "openvino", {"checks": checks, "timing": timing, "rounds": args.rounds,
                               "versions": {"openvino": ov.__version__}}, Path(args.work))


def _merged_openvino(tokenizer, encoder):
    """The encoder's inputs replaced by the tokenizer's outputs of the same names: a string in,
    EMBEDDING out.  The tokenizer's state (its truncation switch, a ReadValue with its Assign sink)
    comes along: openvino-tokenizers' own ``connect_models`` drops the sink and the plugin refuses
    the graph."""
    import openvino as ov

    outputs = {result.output(0).get_any_name(): result.input_value(0) for result in tokenizer.get_results()}
    for parameter in encoder.get_parameters():
        for target in list(parameter.output(0).get_target_inputs()):
            target.replace_source_output(outputs[parameter.output(0).get_any_name()])
    results = [result for result in encoder.get_results() if "EMBEDDING" in result.output(0).get_names()]
    return ov.Model(results, tokenizer.get_sinks(), tokenizer.get_parameters(), "tokenizer_and_encoder")


# ---------------------------------------------------------------- served (the project's venv, after both steps)

#: the one-graph models' python model: strings in, EMBEDDING out, no tokenizer step before it.  With
#: the parameter ``tokenize`` = ``python`` (the control): the same model tokenizing with the tokenizer
#: step's own code (encoding.py) and running the encoder graph, in one step as well.
ONE_GRAPH_MODEL = """
import json
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

INPUTS = ["input_ids", "attention_mask", "token_type_ids"]


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config["parameters"].items()}
        here = Path(args["model_repository"]) / args["model_version"]
        if params["tokenize"] == "python":
            from encoding import encode, load_tokenizer
            tokenizer = load_tokenizer(str(here / "tokenizer.json"), int(params["max_length"]))
            feeds = lambda texts: encode(tokenizer, texts, INPUTS, int(params["pad_id"]), int(params["max_length"]))
        if params["runtime"] == "openvino":
            import openvino as ov
            core = ov.Core()
            core.add_extension(params["extension"])
            compiled = core.compile_model(core.read_model(str(here / "model.xml")), "CPU",
                                          {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_PRECISION_HINT": "f32"})
            request, port = compiled.create_infer_request(), compiled.output("EMBEDDING")
            if params["tokenize"] == "python":
                self.run = lambda texts: request.infer(feeds(texts))[port].copy()
            else:
                self.run = lambda texts: request.infer([np.array(texts)])[port].copy()
        else:
            import onnxruntime as ort
            options = ort.SessionOptions()
            options.intra_op_num_threads = 0
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
            options.register_custom_ops_library(params["extension"])
            session = ort.InferenceSession(str(here / "model.onnx"), options)
            if params["tokenize"] == "python":
                self.run = lambda texts: session.run(["EMBEDDING"], feeds(texts))[0]
            else:  # the BertTokenizer op reads one text (two would be a pair)
                self.run = lambda texts: np.concatenate([
                    session.run(["EMBEDDING"], {"text": np.array([t], dtype=object)})[0] for t in texts])

    def execute(self, requests):
        # every request of the execution in one run, as the ensemble's encoder step runs them
        texts = [[t.decode("utf-8") for t in pb_utils.get_input_tensor_by_name(r, "TEXT").as_numpy().reshape(-1)]
                 for r in requests]
        vectors = self.run([text for request in texts for text in request])
        answers, start = [], 0
        for request in texts:
            rows = vectors[start:start + len(request)]
            answers.append(pb_utils.InferenceResponse([pb_utils.Tensor("EMBEDDING", rows)]))
            start += len(request)
        return answers
"""

ONE_GRAPH_CONFIG = """name: "{name}"
backend: "python"
max_batch_size: 64
input {{ name: "TEXT" data_type: TYPE_STRING dims: 1 }}
output {{ name: "EMBEDDING" data_type: TYPE_FP32 dims: {hidden} }}
instance_group {{ count: 1 kind: KIND_CPU }}
dynamic_batching {{ }}
parameters {{ key: "runtime" value {{ string_value: "{runtime}" }} }}
parameters {{ key: "extension" value {{ string_value: "{extension}" }} }}
parameters {{ key: "tokenize" value {{ string_value: "{tokenize}" }} }}
parameters {{ key: "max_length" value {{ string_value: "{max_length}" }} }}
parameters {{ key: "pad_id" value {{ string_value: "{pad_id}" }} }}
"""


def served_step(args) -> None:
    """The ensembles as served (tokenizer step, then the encoder shim) against one python model
    running the one graph, over gRPC, a single short query at a time, interleaved query by query."""
    import shutil
    import subprocess

    work = Path(args.work)
    setup = json.loads((work / "setup.json").read_text())
    repository = work / "served"
    shutil.rmtree(repository, ignore_errors=True)
    repository.mkdir()
    source = Path(args.repository)
    ensembles = args.ensembles.split(",")
    for name in ensembles:
        for folder in source.glob(f"{name}*"):
            if folder.name in {name, f"{name}_tokenizer", f"{name}_encoder", f"{name}_tokens"}:
                shutil.copytree(folder, repository / folder.name)
    graphs = {"onnxruntime": ("model.onnx", Path(setup["onnx"])), "openvino": ("model.xml", Path(setup["openvino"]))}
    for runtime, (graph, encoder) in graphs.items():
        extension = (work / f"one_graph_{runtime}.extension").read_text().strip()
        for kind, tokenize in (("one_graph", "graph"), ("one_step", "python")):
            folder = repository / f"{kind}_{runtime}"
            (folder / "1").mkdir(parents=True)
            if tokenize == "graph":
                shutil.copy(work / f"one_graph_{runtime}{Path(graph).suffix}", folder / "1" / graph)
                if runtime == "openvino":
                    shutil.copy(work / "one_graph_openvino.bin", folder / "1" / "model.bin")
            else:
                shutil.copy(encoder, folder / "1" / graph)
                if runtime == "openvino":
                    shutil.copy(encoder.with_suffix(".bin"), folder / "1" / "model.bin")
                shutil.copy(Path(setup["model_dir"]) / "tokenizer.json", folder / "1")
                shutil.copy(ROOT / "exporter" / "triton" / "python_models" / "encoding.py", folder / "1")
            (folder / "1" / "model.py").write_text(ONE_GRAPH_MODEL)
            (folder / "config.pbtxt").write_text(ONE_GRAPH_CONFIG.format(
                name=folder.name, hidden=args.hidden, runtime=runtime, extension=extension, tokenize=tokenize,
                max_length=setup["max_length"], pad_id=setup["pad_id"]))
    server = subprocess.Popen([sys.executable, "-m", "nexus_sli.cli.main", "serve", "--model-repository",
                               str(repository), "--grpc-port", str(args.port), "--http-port", str(args.port + 1),
                               "--metrics-port", str(args.port + 2), "--gateway-port", "0"])
    try:
        found = _served_timing(setup, [*ensembles, *(f"{kind}_{runtime}" for kind in ("one_graph", "one_step")
                                                     for runtime in graphs)], args)
    finally:
        server.terminate()
        server.wait(60)
    report_served(setup, found, args, work)


def _served_timing(setup: dict, models: list[str], args) -> dict:
    import tritonclient.grpc as grpc

    client = grpc.InferenceServerClient(f"127.0.0.1:{args.port}")
    deadline = time.time() + 300
    while time.time() < deadline and not all(_ready(client, m) for m in models):
        time.sleep(1)

    def query(model):
        def run(text):
            tensor = grpc.InferInput("TEXT", [1, 1], "BYTES")
            tensor.set_data_from_numpy(np.array([[text.encode("utf-8")]], dtype=object))
            return client.infer(model, [tensor], outputs=[grpc.InferRequestedOutput("EMBEDDING")])
        return run

    variants = {model: query(model) for model in models}
    ensembles = [m for m in models if not m.startswith("one_")]
    pairs = []
    for runtime in ("onnxruntime", "openvino"):
        ensemble = next(m for m in ensembles if ("_ov_" in m) == (runtime == "openvino"))
        pairs += [(f"one_graph_{runtime}", ensemble), (f"one_step_{runtime}", ensemble),
                  (f"one_graph_{runtime}", f"one_step_{runtime}")]
    return summarize(interleave(variants, setup["short"], args.rounds), pairs)


def _ready(client, model) -> bool:
    try:
        return client.is_model_ready(model)
    except Exception:  # noqa: BLE001 - not up yet
        return False


def report_served(setup: dict, timing: dict, args, work: Path) -> None:
    print(f"\n## served over gRPC, a single short query: {setup['model']} on {setup['cpu']} ({setup['cores']} cores; "
          f"{setup['cpu_class']}: {', '.join(setup['isa'])}), {args.rounds} rounds\n")
    print_timing(timing, "model")
    (work / "served.json").write_text(json.dumps(timing, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    steps = parser.add_subparsers(dest="step", required=True)
    first = steps.add_parser("prepare")
    first.add_argument("work")
    first.add_argument("--repository", default="bench/.repo")
    first.add_argument("--model", default=None, help="as nexus-sli export's --model (default: the packaged model)")
    first.add_argument("--tokenizer", default="all_minilm_l6_v2_tokenizer")
    first.add_argument("--onnx", default="all_minilm_l6_v2_encoder")
    first.add_argument("--openvino", default="all_minilm_l6_v2_ov_int8_encoder")
    for name in ("onnxruntime", "openvino"):
        step = steps.add_parser(name)
        step.add_argument("work")
        step.add_argument("--rounds", type=int, default=10)
    last = steps.add_parser("served")
    last.add_argument("work")
    last.add_argument("--repository", default="bench/.repo")
    last.add_argument("--ensembles", default="all_minilm_l6_v2,all_minilm_l6_v2_ov_int8")
    last.add_argument("--hidden", type=int, default=384)
    last.add_argument("--port", type=int, default=48101)
    last.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    {"prepare": prepare, "onnxruntime": onnxruntime_step, "openvino": openvino_step,
     "served": served_step}[args.step](args)


if __name__ == "__main__":
    main()
