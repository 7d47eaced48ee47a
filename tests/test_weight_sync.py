"""Weight sync from the Megatron learner to real CPU engine processes over gloo."""

import pytest
import torch

from distributed import run_ranks
from engine_fixtures import start_engine
from megatron_rlvr.weight_sync.buckets import bucket_layout, buckets, pack, unpack


def test_buckets_keep_one_dtype_stay_under_the_limit_and_unpack_to_views():
    named = [(f"w{i}", torch.randn(10, 10)) for i in range(5)] + [("b", torch.ones(7, dtype=torch.bfloat16)),
                                                                 ("big", torch.randn(100, 10))]
    out = list(buckets(named, max_bytes=1200))
    assert all(len({b.dtype}) == 1 for b in out)
    assert sorted(b.names for b in out) == [["b"], ["big"], ["w0", "w1", "w2"], ["w3", "w4"]]
    assert all(b.nbytes <= 1200 for b in out if b.names != ["big"])  # a larger tensor goes alone
    for bucket in out:
        views = unpack(bucket.buffer, [bucket.dtype] * len(bucket.names), bucket.shapes)
        for name, view in zip(bucket.names, views):
            assert torch.equal(view, dict(named)[name])
            assert view.untyped_storage().data_ptr() == bucket.buffer.untyped_storage().data_ptr()


def test_layout_refuses_unaligned_mixed_dtypes():
    with pytest.raises(ValueError, match="unaligned"):
        bucket_layout([torch.bfloat16, torch.float32], [[3], [2]])
    with pytest.raises(ValueError, match="one dtype"):
        pack([("a", torch.ones(2)), ("b", torch.ones(2, dtype=torch.float64))])


@pytest.fixture(scope="module")
def engines(tiny_hf_dir, tmp_path_factory):
    started = [start_engine(tiny_hf_dir, tmp_path_factory.mktemp(f"sync-engine{i}")) for i in range(2)]
    yield started
    for engine in started:
        engine.stop()


LAYOUTS = {"world1": (1, []), "tp2-sp": (2, ["parallel.tp=2"]), "ep2": (2, ["parallel.ep=2"]),
           "pp2": (2, ["parallel.pp=2"])}


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
def test_after_a_sync_every_engine_tensor_equals_the_learners(layout, engines, tiny_hf_dir, tmp_path):
    world, overrides = LAYOUTS[layout]
    urls = ",".join(e.url for e in engines)
    results = run_ranks(world, ["sync", str(tiny_hf_dir), "weight_sync.bucket_mb=0.05", *overrides], tmp_path,
                        env={"ENGINE_URLS": urls})
    source = results[0]
    assert source["checked"] == 2 * 45 and source["mismatched"] == []
    metrics = source["metrics"]
    assert metrics["weight_sync/buckets"] > 3  # small buckets: several, pipelined
    assert metrics["weight_sync/parity_max_gap"] <= 1e-5
    assert len(set(source["versions"])) == 1


def test_corrupted_bucket_and_skipped_version_are_detected(engines, tiny_hf_dir, tmp_path):
    r = run_ranks(1, ["sync-integrity", str(tiny_hf_dir), "weight_sync.bucket_mb=0.05"], tmp_path,
                  env={"ENGINE_URLS": engines[0].url})[0]
    assert "rejected bucket 0" in r["corrupted_error"] and "checksum mismatch" in r["corrupted_error"]
    assert r["version_after_corruption"] == r["versions"]  # kept its old version
    assert r["retry_metrics"]["weight_sync/parity_max_gap"] <= 1e-5  # a clean retry then succeeds
    assert "skipped or repeated an update" in r["skipped_error"]
