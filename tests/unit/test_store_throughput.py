"""The throughput line (dflash.store.throughput): the model as a pure function with the 27B fp8 numbers, the
probes on a real S3 server (SeaweedFS on localhost), and the line of training from a URL. The line in
`dflash extract --dry-run --output URL` is checked by tests/e2e/test_store_pipeline.py (it has the model)."""

from store_server import make_cache, s3_env, s3_server  # noqa: F401  (fixtures)

from dflash.store.objects import open_store
from dflash.store.resolve import train_store_line
from dflash.store.sync import publish_cache
from dflash.store.throughput import PROBE_PREFIX, StoreRate, probe_read, probe_write_read, throughput_line
from dflash.train.config import TrainConfig

FP8_27B = 25_625  # B/token: 5 taps x 5120 fp8 + 4 B scale per tap + 5 B ids and mask (docs/multinode.md)


def test_the_line_multiplies_bytes_tokens_and_ranks_against_the_store():
    rate = StoreRate(mb_s=830.0, how="8 x 4 MB PUT, 8 in parallel")
    line = throughput_line(what="written", bytes_per_token=FP8_27B, ranks=8, rate=rate, tokens_per_s=10_000)
    assert "\n" not in line
    assert "25,625 B/token written x 8 ranks" in line and "830 MB/s (8 x 4 MB PUT" in line
    assert "enough for 4,049 tok/s per rank" in line            # 830e6 / (25,625 x 8)
    assert "needs 256.2 MB/s per rank, 2,050.0 MB/s in all" in line
    assert "the store bounds the run at 40% of that speed" in line
    fast = throughput_line(what="written", bytes_per_token=FP8_27B, ranks=8, rate=StoreRate(mb_s=5000, how="p"),
                           tokens_per_s=10_000)
    assert "2.4x headroom" in fast
    unknown = throughput_line(what="read", bytes_per_token=FP8_27B, ranks=1, rate=rate, tokens_per_s=None)
    assert "x 1 rank;" in unknown and "(25.6 MB/s per rank per 1,000 tok/s)" in unknown


def test_probes_measure_and_clean_up(s3_env, tmp_path):
    url = s3_env.create_bucket("dflash-probe") + "/c"
    store = open_store(url)
    write, read = probe_write_read(store, num=3, nbytes=1 << 20, threads=3)
    assert write.mb_s > 0 and read.mb_s > 0 and write.how.startswith("3 x 1 MB PUT")
    assert not [k for k in store.list_keys() if k.startswith(PROBE_PREFIX)]
    assert probe_read(store, []) is None

    make_cache(tmp_path / "local", storage="fp8")
    publish_cache(local=str(tmp_path / "local"), url=url)
    cfg = TrainConfig(cache=url, model="m", output=str(tmp_path / "run"), taps=(3, 9))
    line = train_store_line(cfg, gpus=2)
    # 2 taps x (64 fp8 + 4 B scale) + 5 B ids and mask, read by 2 ranks
    assert "141 B/token read x 2 ranks" in line and "ranged GETs" in line and "per 1,000 tok/s" in line
    assert train_store_line(TrainConfig(cache=str(tmp_path / "local"), model="m", output="o"), gpus=1) is None
