"""The served stack's ceiling harness (bench/stack_ceiling.py): its figures, its page section, and another
revision run beside the checkout with its own code.  ``make bench`` runs the harness itself (minutes)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from nexus_sli.bench import revision, stack_ceiling
from nexus_sli.bench.stack_ceiling import IN_PROCESS, IN_PROCESS_LOAD, LOADS, Record, Variant, section

BATCHES, SINGLES = list(LOADS)


def _round(rows_per_s: float, **cpu) -> dict:
    return {"rows_per_s": rows_per_s, "cpu_us_per_row": cpu}


def _record() -> Record:
    record = Record(6.0, 2, [Variant("checkout"), Variant("baseline", "abc")])
    for label, rates, clients in (("checkout", (300.0, 330.0), 20.0), ("baseline", (100.0, 110.0), 30.0)):
        for rate in rates:
            record.add(label, BATCHES, _round(rate, clients=clients, tritonserver=10.0, **{"stub m": 50.0}))
            record.add(label, SINGLES, _round(rate / 10))
    for rate in (200.0, 220.0):
        record.add(IN_PROCESS, IN_PROCESS_LOAD, _round(rate, **{IN_PROCESS: 90.0}))
    return record


def test_the_summary_is_each_variants_median_beside_the_baseline_and_the_model_in_process():
    summary = _record().summary()
    checkout = summary["checkout"][BATCHES]
    assert checkout["rows_per_s"] == 315.0 and checkout["vs_baseline"] == 3.0 and checkout["vs_in_process"] == 1.5
    assert checkout["cpu_us_per_row"] == {"clients": 20.0, "tritonserver": 10.0, "stub m": 50.0}
    assert summary["baseline"][SINGLES]["vs_baseline"] == 1.0 and summary[IN_PROCESS][IN_PROCESS_LOAD]["rows_per_s"] == 210


def test_the_page_section_has_a_row_per_variant_and_the_model_in_process():
    record = {"summary": _record().summary(), "loads": {name: {} for name in LOADS}, "texts": 497, "rounds": 2,
              "seconds": 6.0, "cpu_class": "amx", "created": "2026-01-01T00:00:00+00:00",
              "checkout": {"commit": "0123456789ab"}, "load_average_at_start": [0.1, 0.2, 0.3],
              "baseline": {"revision": "abc", "why": "the stack before"},
              "variants": [{"label": "checkout", "revision": "checkout"}, {"label": "baseline", "revision": "abc"}],
              "model": {"config": stack_ceiling.FREE_CONFIG, "max_length": stack_ceiling.FREE_MAX_LENGTH}}
    lines = section(record)
    rows = [line for line in lines if line.startswith("| ") and not line.startswith("| variant")]
    assert [row.split(" | ")[0] for row in rows] == ["| checkout", "| baseline",
                                                     "| the model in process, one thread, calls of 32"]
    assert "| 315 | 3.0x | 1.5x | 32 | 3.0x | 20 / 10 / 50, 80 in all |" in rows[0]
    assert "`0123456789ab`" in lines[2] and section(None) == []


def test_the_texts_fit_the_free_model():
    tokenizer = Tokenizer.from_file(str(stack_ceiling.packaged_tokenizer()))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    texts = stack_ceiling.short_texts()
    assert len(texts) > 400 and max(len(e.ids) for e in tokenizer.encode_batch(texts)) <= stack_ceiling.FREE_MAX_LENGTH


def test_a_revision_runs_with_its_own_code_and_this_environments_packages(tmp_path):
    python = revision.interpreter(stack_ceiling.baseline_revision()["revision"], tmp_path)
    found = subprocess.run([str(python), "-c", "import nexus_sli.exporter, numpy; print(nexus_sli.exporter.__file__)"],
                           capture_output=True, text=True, check=True).stdout.strip()
    # its import names lead to the revision's files, extracted under tmp_path
    assert Path(found).resolve().is_relative_to(tmp_path.resolve()) and "source" in Path(found).resolve().parts
    assert revision.interpreter(stack_ceiling.baseline_revision()["revision"], tmp_path) == python  # made once
    with pytest.raises(ValueError, match="does not know the revision 'no-such-revision'"):
        revision.interpreter("no-such-revision", tmp_path)
    assert sys.executable != str(python)
