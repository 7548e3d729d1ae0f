"""The layer cache: fidelity per mode, int8 size and error bounds, staleness,
LRU eviction that survives a restart, damage detection, crash-safe writes."""

from __future__ import annotations

import logging
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from transformers import BertConfig
from transformers.models.bert.modeling_bert import BertLayer

from nexus_sli.exporter.export import layer_cache as lc
from nexus_sli.exporter.errors import LayerIndexError, NexusError
from nexus_sli.exporter.export.layer_cache import LayerCache, LayerCacheError, tensor_digest
from nexus_sli.exporter.export.quantize import Int8Config

GIB = 1024**3


def bert_config() -> BertConfig:
    # The shape of all-MiniLM-L6-v2's layers; dropout off so outputs are deterministic.
    config = BertConfig(hidden_size=384, intermediate_size=1536, num_attention_heads=12,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    config._attn_implementation = "eager"
    return config


@pytest.fixture(scope="module")
def bert():
    """(layer, factory, inputs, reference outputs) for a seeded BertLayer of hidden 384."""
    config = bert_config()
    torch.manual_seed(0)
    layer = BertLayer(config).eval()
    inputs = torch.randn(4, 32, 384, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = layer(inputs)
    return layer, (lambda: BertLayer(config)), inputs, reference


def small_layer(seed: int, width: int = 64) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width))


def outputs_of(layer: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return layer(inputs)


def cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return nn.functional.cosine_similarity(a, b, dim=-1)


# ------------------------------------------------------------------ round trips


def test_none_round_trip_is_exact(tmp_path, bert):
    layer, factory, inputs, reference = bert
    cache = LayerCache(tmp_path, 1)
    cache.cache_layer("minilm", 0, layer, "none")
    rebuilt = cache.get_layer("minilm", 0, factory=factory)
    assert isinstance(rebuilt, BertLayer) and not rebuilt.training
    for name, tensor in layer.state_dict().items():
        assert torch.equal(rebuilt.state_dict()[name], tensor), name
    # Bit-identical weights through the same CPU kernels: identical outputs.
    assert torch.equal(outputs_of(rebuilt, inputs), reference)


def test_fp16_round_trip_within_half_precision(tmp_path, bert):
    layer, factory, inputs, reference = bert
    cache = LayerCache(tmp_path, 1)
    cache.cache_layer("minilm", 0, layer, "fp16")
    out = outputs_of(cache.get_layer("minilm", 0, factory=factory), inputs)
    # fp16 rounds each weight by at most 2**-11 relative (~4.9e-4); over 384- and
    # 1536-term dot products the errors mostly cancel and LayerNorm keeps outputs
    # at unit scale, so the measured max abs error is ~2.5e-4: 1e-3 leaves 4x headroom.
    assert (out - reference).abs().max() <= 1e-3


def test_int8_round_trip_keeps_outputs(tmp_path, bert):
    layer, factory, inputs, reference = bert
    cache = LayerCache(tmp_path, 1)
    cache.cache_layer("minilm", 0, layer, "int8")
    out = outputs_of(cache.get_layer("minilm", 0, factory=factory), inputs)
    quantized = cosine(out, reference)
    assert quantized.min() >= 0.99
    # The bar is meaningful only if the layer itself moves its input much more
    # than quantization moves its output.
    moved_by_layer = 1 - cosine(reference, inputs).mean()
    assert (1 - quantized.mean()) < 0.01 * moved_by_layer


def test_int8_weights_within_half_a_step_per_row(tmp_path, bert):
    layer = bert[0]
    cache = LayerCache(tmp_path, 1)
    path = cache.cache_layer("minilm", 0, layer, "int8")
    stored = load_file(path)
    restored = cache.get_state_dict("minilm", 0)
    matrices = 0
    for name, weight in layer.state_dict().items():
        if weight.dim() == 1:  # biases and LayerNorm stay fp32, bit for bit
            assert stored[name].dtype == torch.float32 and torch.equal(restored[name], weight), name
            continue
        matrices += 1
        scale = stored[name + ":scale"]
        assert stored[name].dtype == torch.int8
        torch.testing.assert_close(scale, weight.abs().amax(dim=1) / 127)  # symmetric, per output row
        row_error = (restored[name] - weight).abs().amax(dim=1)
        # Rounding to the nearest step errs by at most half a step (plus fp32 rounding).
        assert torch.all(row_error <= scale / 2 * (1 + 1e-5) + 1e-7), name
    assert matrices == 6  # q, k, v, attention output, intermediate, output


def test_int8_settings_come_from_get_int8_config(tmp_path, monkeypatch):
    layer = small_layer(0)
    cache = LayerCache(tmp_path, 1)
    cache.cache_layer("m", 0, layer, "int8")
    monkeypatch.setattr(lc, "get_int8_config", lambda: Int8Config(per_channel=False, reduce_range=True))
    # Quantized under other settings: a miss, not a silently different layer.
    assert cache.get_state_dict("m", 0) is None
    path = cache.cache_layer("m", 0, layer, "int8")
    scale = load_file(path)["0.weight:scale"]
    weight = layer.state_dict()["0.weight"]
    assert scale.shape == (1,) and torch.isclose(scale[0], weight.abs().max() / 63)
    assert cache.get_state_dict("m", 0) is not None


def test_int8_entry_is_at_most_30_percent_of_fp32(tmp_path, bert):
    layer = bert[0]
    cache = LayerCache(tmp_path, 1)
    fp32 = cache.cache_layer("minilm", 0, layer, "none").stat().st_size
    fp16 = cache.cache_layer("minilm", 1, layer, "fp16").stat().st_size
    int8 = cache.cache_layer("minilm", 2, layer, "int8").stat().st_size
    assert fp32 >= 4 * sum(t.numel() for t in layer.state_dict().values())
    assert int8 <= 0.30 * fp32  # measured 25.4%: 1 byte per weight plus fp32 scales, biases, norms
    assert fp16 <= 0.51 * fp32


def test_get_layer_without_factory_in_the_same_process(tmp_path, bert):
    layer, _, inputs, reference = bert
    cache = LayerCache(tmp_path, 1)
    cache.cache_layer("minilm", 3, layer, "none")
    # The seed's call shape: the cache kept a weightless copy of the layer's structure.
    rebuilt = cache.get_layer("minilm", 3)
    assert isinstance(rebuilt, BertLayer) and rebuilt is not layer
    assert torch.equal(outputs_of(rebuilt, inputs), reference)
    # A new instance (as in another process) has no structure to rebuild from.
    with pytest.raises(LayerCacheError, match="factory"):
        LayerCache(tmp_path, 1).get_layer("minilm", 3)
    assert LayerCache(tmp_path, 1).get_state_dict("minilm", 3) is not None


def test_mode_filter_and_factory_mismatch(tmp_path):
    cache = LayerCache(tmp_path, 1)
    cache.cache_layer("m", 0, small_layer(0), "fp16")
    assert cache.get_state_dict("m", 0, quantization_mode="int8") is None
    assert cache.get_state_dict("m", 0, quantization_mode="fp16") is not None
    with pytest.raises(LayerCacheError, match="does not fit"):
        cache.get_layer("m", 0, factory=lambda: nn.Linear(64, 64))


# ------------------------------------------------------------------ keys and hashes


def test_tensor_digest_sees_names_shapes_dtypes_and_bytes():
    base = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.zeros(4)}
    digest = tensor_digest(base)
    assert digest == tensor_digest({"b": torch.zeros(4), "w": base["w"].clone()})  # order-free, content only
    assert digest == tensor_digest({**base, "w": base["w"].t().contiguous().t()})  # layout does not matter
    changed = base["w"].clone()
    changed[2, 3] += 1
    for variant in ({**base, "w": changed}, {**base, "w": base["w"].reshape(4, 3)},
                    {**base, "w": base["w"].double()}, {"W": base["w"], "b": base["b"]}):
        assert tensor_digest(variant) != digest
    assert tensor_digest({"x": torch.tensor(1.0, dtype=torch.bfloat16)})  # dtypes numpy lacks, 0-d


def test_a_different_source_hash_misses(tmp_path):
    layer = small_layer(0)
    old = tensor_digest(layer.state_dict())
    cache = LayerCache(tmp_path, 1)
    cache.cache_layer("m", 0, layer, "int8", source_hash=old)
    with torch.no_grad():
        layer[0].weight[0, 0] += 1  # the checkpoint changed
    new = tensor_digest(layer.state_dict())
    assert new != old
    assert cache.get_layer("m", 0, factory=lambda: small_layer(1), source_hash=new) is None
    assert cache.get_state_dict("m", 0) is None  # no hash is a key of its own, too
    assert cache.get_state_dict("m", 0, source_hash=old) is not None
    assert cache.get_state_dict("m", 1, source_hash=old) is None
    assert cache.get_state_dict("other", 0, source_hash=old) is None


def test_bad_arguments_are_typed_errors(tmp_path):
    cache = LayerCache(tmp_path, 1)
    with pytest.raises(LayerCacheError, match="'int8', 'fp16', 'none'"):
        cache.cache_layer("m", 0, small_layer(0), "int4")
    with pytest.raises(LayerCacheError, match="valid modes"):
        cache.get_state_dict("m", 0, quantization_mode="bf16")
    for size in (-1, -0.001, float("nan"), "ten"):
        with pytest.raises(LayerCacheError):
            LayerCache(tmp_path, size)
    with pytest.raises(LayerIndexError):
        cache.cache_layer("m", -1, small_layer(0))
    with pytest.raises(LayerCacheError):
        cache.cache_layer("", 0, small_layer(0))
    with pytest.raises(LayerCacheError):
        cache.cache_layer("m", 0, {"w": torch.zeros(2)})
    assert issubclass(LayerCacheError, NexusError) and issubclass(LayerCacheError, ValueError)


# ------------------------------------------------------------------ eviction


def test_lru_eviction_order_survives_a_new_instance(tmp_path):
    probe = LayerCache(tmp_path / "probe", 1).cache_layer("m", 0, small_layer(0), "none")
    entry = probe.stat().st_size
    budget_gb = 3.5 * entry / GIB  # room for three entries
    cache = LayerCache(tmp_path / "cache", budget_gb)
    for index in range(3):  # 0, 1, 2
        cache.cache_layer("m", index, small_layer(index), "none")
    assert cache.get_state_dict("m", 0) is not None  # 0 is now the most recent
    cache.cache_layer("m", 3, small_layer(3), "none")
    assert present(cache, range(5)) == [0, 2, 3]  # 1 was least recently used
    assert cache.size_bytes() <= cache.max_bytes

    reopened = LayerCache(tmp_path / "cache", budget_gb)  # recency lives on disk
    assert reopened.get_state_dict("m", 2) is not None  # order now 0, 3, 2
    reopened.cache_layer("m", 4, small_layer(4), "none")
    assert present(reopened, range(5)) == [2, 3, 4]
    assert reopened.size_bytes() <= reopened.max_bytes


def present(cache: LayerCache, indices) -> list[int]:
    return [i for i in indices if cache.entry_path("m", i).exists()]


def test_an_entry_larger_than_the_bound_is_not_stored(tmp_path, caplog):
    cache = LayerCache(tmp_path, 1000 / GIB)
    with caplog.at_level(logging.WARNING, logger=lc.__name__):
        assert cache.cache_layer("m", 0, small_layer(0), "none") is None
    assert "exceeds the cache bound" in caplog.text
    assert cache.size_bytes() == 0


def test_a_layer_too_large_to_cache_leaves_no_older_layer_under_its_key(tmp_path):
    """cache_layer replaces the entry of its key: one it cannot store must not leave the older layer to be read."""
    sizes = {}
    for mode in ("int8", "none"):
        probe = LayerCache(tmp_path / mode, 1)
        sizes[mode] = probe.cache_layer("m", 0, small_layer(0), mode).stat().st_size
    cache = LayerCache(tmp_path / "bounded", (sizes["int8"] + sizes["none"]) / 2 / GIB)
    assert cache.cache_layer("m", 0, small_layer(0), "int8") is not None
    assert cache.cache_layer("m", 0, small_layer(1), "none") is None  # too large: not stored
    assert cache.get_state_dict("m", 0) is None
    with pytest.raises(LayerCacheError, match="factory"):  # nor its structure kept to rebuild from
        cache.get_layer("m", 0)


def test_a_layer_rebuilt_without_a_factory_has_the_structure_of_its_own_entry(tmp_path):
    """Two entries of one (model, layer) under two source hashes: each rebuilt as it was cached."""
    cache = LayerCache(tmp_path, 1)
    gelu, relu = nn.Sequential(nn.Linear(8, 8), nn.GELU()), nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    cache.cache_layer("m", 0, gelu, "none", source_hash="h1")
    cache.cache_layer("m", 0, relu, "none", source_hash="h2")
    assert isinstance(cache.get_layer("m", 0, source_hash="h1")[1], nn.GELU)
    assert isinstance(cache.get_layer("m", 0, source_hash="h2")[1], nn.ReLU)


# ------------------------------------------------------------------ damage and crashes


def flip_byte(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


DAMAGE = {
    "flipped data byte": lambda path: flip_byte(path, path.stat().st_size - 100),
    "flipped header byte": lambda path: flip_byte(path, 40),
    "truncated": lambda path: os.truncate(path, path.stat().st_size // 2),
    "header only": lambda path: os.truncate(path, 7),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_entry_is_a_logged_miss_and_is_rebuilt(tmp_path, caplog, damage):
    layer = small_layer(0)
    cache = LayerCache(tmp_path, 1)
    path = cache.cache_layer("m", 0, layer, "int8")
    DAMAGE[damage](path)
    with caplog.at_level(logging.WARNING, logger=lc.__name__):
        assert cache.get_layer("m", 0, factory=lambda: small_layer(1)) is None
    assert "damaged" in caplog.text and path.name in caplog.text
    assert not path.exists()  # deleted, so it is never tried again
    cache.cache_layer("m", 0, layer, "int8")  # the caller rebuilds from the checkpoint
    rebuilt = cache.get_layer("m", 0, factory=lambda: small_layer(1))
    x = torch.randn(3, 64)
    assert cosine(outputs_of(rebuilt, x), outputs_of(layer, x)).min() >= 0.99


def test_a_simulated_crash_mid_write_leaves_nothing_that_loads(tmp_path):
    cache = LayerCache(tmp_path, 1)
    intact = cache.cache_layer("m", 0, small_layer(0), "none")
    torn = cache.cache_layer("m", 1, small_layer(1), "none")
    os.truncate(torn, torn.stat().st_size - 10)  # as if the disk lost the tail
    dead = dead_pid()
    temp = tmp_path / f".{cache.entry_path('m', 2).name}.{dead}.abcd1234.tmp"
    temp.write_bytes(intact.read_bytes()[:1000])  # a writer killed before os.replace
    reopened = LayerCache(tmp_path, 1)
    assert not temp.exists()  # its writer is dead: cleaned up
    assert reopened.get_state_dict("m", 0) is not None
    assert reopened.get_state_dict("m", 1) is None and not torn.exists()
    assert reopened.get_state_dict("m", 2) is None


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


WRITER = textwrap.dedent("""
    import os, sys, time
    import torch
    from torch import nn
    from nexus_sli.exporter.export import layer_cache as lc

    cache_dir, count, pause_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    real_replace, replaces = os.replace, [0]

    def replace(src, dst):  # hold still just before the rename of write number pause_at
        replaces[0] += 1
        if replaces[0] == pause_at:
            print("paused", flush=True)
            time.sleep(60)
        real_replace(src, dst)

    os.replace = replace
    cache = lc.LayerCache(cache_dir, 1)
    for i in range(count):
        torch.manual_seed(i)
        layer = nn.Sequential(nn.Linear(256, 256), nn.LayerNorm(256))
        cache.cache_layer("m", i, layer, ("int8", "fp16", "none")[i % 3], source_hash=str(i))
        print("done", i, flush=True)
""")


def kill_writer(cache_dir, count: int, pause_at: int, after_done: int | None = None) -> int:
    """Run WRITER, SIGKILL it when it pauses (or after it reports ``after_done``); return its pid."""
    errors = cache_dir.parent / "writer.stderr"
    with open(errors, "w") as stderr:
        child = subprocess.Popen([sys.executable, "-c", WRITER, str(cache_dir), str(count), str(pause_at)],
                                 stdout=subprocess.PIPE, stderr=stderr, text=True)
    for line in child.stdout:
        if line.strip() == "paused" or line.strip() == f"done {after_done}":
            break
    else:  # it ended on its own: say why rather than failing on the entries
        child.wait()
        pytest.fail(f"the writer exited with {child.returncode} before it was killed:\n{errors.read_text()}")
    if after_done is not None:
        # land somewhere in a later write; seeded, so a failing run can be repeated
        time.sleep(random.Random(after_done).uniform(0, 0.02))
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    child.stdout.close()
    return child.pid


def expected_state(tmp_path, index: int) -> dict:
    """What entry ``index`` decodes to when written by an undisturbed process."""
    torch.manual_seed(index)
    layer = nn.Sequential(nn.Linear(256, 256), nn.LayerNorm(256))
    reference = LayerCache(tmp_path / "reference", 1)
    reference.cache_layer("m", index, layer, ("int8", "fp16", "none")[index % 3], source_hash=str(index))
    return reference.get_state_dict("m", index, source_hash=str(index))


def assert_loaded_entries_intact(tmp_path, cache_dir, count: int) -> list[int]:
    cache = LayerCache(cache_dir, 1)
    loaded = []
    for index in range(count):
        state = cache.get_state_dict("m", index, source_hash=str(index))
        if state is not None:
            expected = expected_state(tmp_path, index)
            assert all(torch.equal(state[k], expected[k]) for k in expected), index
            loaded.append(index)
    assert not list(cache_dir.glob(".*.tmp"))  # the dead writer's temp file was removed
    return loaded


def test_sigkill_during_a_write_leaves_only_intact_entries(tmp_path):
    cache_dir = tmp_path / "cache"
    kill_writer(cache_dir, count=20, pause_at=6)
    assert len(list(cache_dir.glob(".*.tmp"))) == 1  # it really died inside a write
    assert assert_loaded_entries_intact(tmp_path, cache_dir, 20) == [0, 1, 2, 3, 4]


def test_sigkill_at_a_random_moment_leaves_only_intact_entries(tmp_path):
    cache_dir = tmp_path / "cache"
    kill_writer(cache_dir, count=200, pause_at=0, after_done=9)
    loaded = assert_loaded_entries_intact(tmp_path, cache_dir, 200)
    # Every write that reported done had been fsynced and renamed.
    assert loaded[:10] == list(range(10)) and loaded == list(range(len(loaded)))
