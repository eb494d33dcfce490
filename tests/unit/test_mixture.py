"""Several caches in one run: the mixture plan (pure), the mixed reader, the compatibility refusal, the YAML and
CLI forms, per-cache metrics, and a weighted run cut and resumed (CPU, tiny real target and caches)."""

import json
import pathlib
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from test_train_defects import _cut_and_resume_losses, _steps_and_losses  # noqa: E402
from train_helpers import tiny_cache, tiny_config, tiny_target  # noqa: E402

from dflash.errors import CacheMismatchError, ConfigError  # noqa: E402
from dflash.train.mixture import interleave, mixture_epoch, per_cache_counts, slots_before  # noqa: E402


# ------------------------------------------------------------------------------------------------ pure plan


def test_slots_before_follows_the_weights_within_one_sample():
    for k in (0, 1, 7, 100, 1001):
        got = slots_before(k, (3.0, 1.0))
        assert got.sum() == k
        assert np.all(np.abs(got - k * np.array([0.75, 0.25])) < 1)
    assert slots_before(8, (1.0, 2.0, 1.0)).tolist() == [2, 4, 2]


def test_interleave_spreads_each_cache_evenly():
    ids = interleave(np.array([6, 2]))
    assert ids.tolist() == [0, 0, 1, 0, 0, 0, 1, 0]  # keys 1/12, 3/12, 1/4(cache 1), ...
    ids = interleave(np.array([300, 100]))
    for w in range(8, len(ids) + 1, 8):  # every prefix within one sample per cache of 3:1
        assert abs((ids[:w] == 1).sum() - w / 4) <= 1


def test_mixture_epoch_is_deterministic_and_exact():
    a = mixture_epoch(counts=[10, 30], weights=(3, 1), seed=0, epoch=0)
    b = mixture_epoch(counts=[10, 30], weights=(3, 1), seed=0, epoch=0)
    assert np.array_equal(a.order, b.order)
    assert len(a.order) == 40 and (a.cache == 0).sum() == 30 and (a.cache == 1).sum() == 10
    assert np.array_equal(a.order, np.where(a.cache == 0, 0, 10) + a.local)
    # cache 0 (10 samples, 30 slots) is repeated: 3 whole shuffled passes, each sample 3 times
    assert np.bincount(a.local[a.cache == 0], minlength=10).tolist() == [3] * 10
    # cache 1 (30 samples, 10 slots per epoch) is subsampled: epochs 0-2 together take each sample once
    taken = np.concatenate([mixture_epoch(counts=[10, 30], weights=(3, 1), seed=0, epoch=e).local[
        mixture_epoch(counts=[10, 30], weights=(3, 1), seed=0, epoch=e).cache == 1] for e in range(3)])
    assert sorted(taken.tolist()) == list(range(30))
    c = mixture_epoch(counts=[10, 30], weights=(3, 1), seed=1, epoch=0)
    assert not np.array_equal(a.order, c.order)


def test_mixture_without_weights_pressure_keeps_every_sample_once():
    p = mixture_epoch(counts=[5, 15], weights=(1, 3), seed=2, epoch=4)  # weights = size shares
    assert sorted(p.order.tolist()) == list(range(20))


def test_bad_weights_are_refused():
    with pytest.raises(ConfigError, match="one per --cache"):
        mixture_epoch(counts=[5, 5], weights=(1,), seed=0, epoch=0)
    with pytest.raises(ConfigError, match="positive"):
        mixture_epoch(counts=[5, 5], weights=(1, 0), seed=0, epoch=0)


def test_per_cache_counts():
    s, t = per_cache_counts(np.array([0, 4, 5, 5, 9]), offsets=np.array([0, 5]),
                            lengths=np.arange(10) + 1, num_caches=2)
    assert s.tolist() == [2, 3] and t.tolist() == [1 + 5, 6 + 6 + 10]


# ------------------------------------------------------------------------------------- config and CLI forms


def test_yaml_caches_form(tmp_path):
    from dflash.train.config import load_train_config

    y = tmp_path / "c.yaml"
    y.write_text("caches:\n  - {path: A, weight: 3}\n  - {path: s3://b/B, weight: 1}\n")
    cfg = load_train_config(y, dict(model="M", output="O"))
    assert cfg.cache_paths == ("A", "s3://b/B") and cfg.cache_weights == (3.0, 1.0)
    y.write_text("caches:\n  - {path: A, weight: 3}\n  - {path: B}\n")
    with pytest.raises(ConfigError, match="every entry a weight"):
        load_train_config(y, dict(model="M", output="O"))
    with pytest.raises(ConfigError, match="one per --cache"):
        tiny_config(cache="A", extra_caches=("B",), cache_weights=(1, 2, 3), model="M", output="O")
    with pytest.raises(ConfigError, match="given twice"):
        tiny_config(cache="A", extra_caches=("A",), model="M", output="O")


def test_cli_takes_several_caches_and_weights(tmp_path, monkeypatch):
    from click.testing import CliRunner

    import dflash.train.launch as launch_mod
    from cli.main import cli

    seen = {}
    monkeypatch.setattr(launch_mod, "launch", lambda cfg, **kw: seen.setdefault("cfg", cfg))
    r = CliRunner().invoke(cli, ["train", "--cache", "A", "--cache", "B", "--cache-weights", "3,1", "--model", "M",
                                 "--output", str(tmp_path / "o"), "--init-from", "D"])
    cfg = seen["cfg"]
    assert cfg.cache_paths == ("A", "B") and cfg.cache_weights == (3.0, 1.0) and cfg.init_from == "D", r.output


# ---------------------------------------------------------------------------------- reader and training runs


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    d = tmp_path_factory.mktemp("mixture")
    target = tiny_target(d / "target")
    a = tiny_cache(d / "a", target, num_samples=12, seed=0)
    b = tiny_cache(d / "b", target, num_samples=18, seed=1)
    return str(target), str(a), str(b), d


@pytest.fixture(autouse=True)
def _quiet(monkeypatch):
    monkeypatch.setenv("DFLASH_NO_PROGRESS", "1")


def test_mixed_reader_reads_each_cache_sample(assets):
    from dflash.cache import CacheReader
    from dflash.cache.mixed import MixedReader

    _, a, b, _ = assets
    ra, rb = CacheReader(a), CacheReader(b)
    mixed = MixedReader([CacheReader(a), CacheReader(b)])
    idx = [13, 0, 29, 5, 12]  # b1, a0, b17, a5, b0
    got = mixed.read_many(idx, taps=(0, 2))
    parts = [rb.read_many([1], taps=(0, 2)), ra.read_many([0], taps=(0, 2)), rb.read_many([17], taps=(0, 2)),
             ra.read_many([5], taps=(0, 2)), rb.read_many([0], taps=(0, 2))]
    assert torch.equal(got.hidden, torch.cat([p.hidden for p in parts]))
    assert np.array_equal(got.input_ids, np.concatenate([p.input_ids for p in parts]))
    assert mixed.cache_of(idx).tolist() == [1, 0, 1, 0, 1]


def test_caches_of_other_taps_or_storage_are_refused(assets, tmp_path):
    from dflash.cache import CacheReader
    from dflash.cache.mixed import MixedReader

    model, a, _, d = assets
    other = tiny_cache(tmp_path / "taps", pathlib.Path(model), num_samples=6, taps=(0, 1, 3))
    with pytest.raises(CacheMismatchError, match="tap_layer_ids"):
        MixedReader([CacheReader(a), CacheReader(str(other))])
    fp8 = tiny_cache(tmp_path / "fp8", pathlib.Path(model), num_samples=6, storage="fp8")
    with pytest.raises(CacheMismatchError, match="storage .*the caches of one run must share"):
        MixedReader([CacheReader(a), CacheReader(str(fp8))])


def test_weighted_run_resumes_exactly_and_counts_per_cache(assets, tmp_path):
    """A 3:1 run cut after 3 steps and resumed gives the uninterrupted run's losses; metrics.jsonl, the model
    card and the plan agree on the samples and tokens seen per cache."""
    from dflash.cache import CacheReader
    from dflash.cache.mixed import MixedReader
    from dflash.drafter.card import read_card_data
    from dflash.train.loader import config_plan
    from dflash.train.metrics import read_metrics
    from dflash.train.trainer import train

    model, a, b, _ = assets
    kw = dict(cache=a, extra_caches=(b,), cache_weights=(3, 1), model=model, steps=7, save_every=2)
    train(tiny_config(output=str(tmp_path / "ref"), **kw), device="cpu")
    ref = _steps_and_losses(tmp_path / "ref")
    assert ref[0] == list(range(1, 8))
    assert _cut_and_resume_losses(tmp_path / "cut", kw, cut=3) == ref[1]

    last = read_metrics(tmp_path / "ref")[-1]
    reader = MixedReader([CacheReader(a), CacheReader(b)])
    cfg = tiny_config(output="unused", **kw)
    steps = []
    epoch = 0
    while len(steps) < 7:
        steps += list(config_plan(cfg, reader.index, epoch=epoch, world_size=1, counts=reader.counts).steps)
        epoch += 1
    idx = np.concatenate([mb for s in steps[:7] for mb in s])
    want_s, want_t = per_cache_counts(idx, offsets=reader.offsets, lengths=reader.index.length, num_caches=2)
    assert list(last["cache_samples"].values()) == want_s.tolist()
    assert list(last["cache_tokens"].values()) == want_t.tolist()
    assert abs(want_s[0] / want_s.sum() - 0.75) < 0.1
    assert read_metrics(tmp_path / "cut")[-1]["cache_samples"] == last["cache_samples"]
    card = read_card_data(tmp_path / "ref" / "drafter")
    assert card["data"]["cache_samples"] == last["cache_samples"]
    assert "samples seen" in (tmp_path / "ref" / "drafter" / "README.md").read_text()
    cfgjson = json.loads((tmp_path / "ref" / "config.json").read_text())
    assert cfgjson["train"]["cache_weights"] == [3, 1]


# ------------------------------------------------------------------------------------------------ --init-from


def _init_state(cfg):
    from dflash.train.distributed import DistInfo
    from dflash.train.setup import setup_drafter, setup_target

    info = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    target = setup_target(cfg, info=info)
    try:
        return setup_drafter(cfg, target, info=info, resume_state=None)
    finally:
        target.reader.close()


def test_init_from_a_run_or_a_drafter_folder_starts_from_its_weights(assets, tmp_path):
    """A new run on another cache mixture starts from the trained weights of a run folder (its newest checkpoint)
    or of its exported drafter folder (z-lab's format), with the drafter's shape and taps; it then trains."""
    from dflash.train.checkpoint import latest_checkpoint, load_checkpoint
    from dflash.train.trainer import train

    model, a, b, _ = assets
    first = tmp_path / "first"
    train(tiny_config(cache=a, model=model, output=str(first), steps=3, taps=(0, 2)), device="cpu")
    trained = load_checkpoint(latest_checkpoint(first))["model"]
    for src in (first, first / "drafter"):
        d = _init_state(tiny_config(cache=b, extra_caches=(a,), model=model, output="unused", init_from=str(src)))
        assert d.drafter_config.target_layer_ids == (0, 2)
        got = d.drafter.state_dict()
        for name, t in trained.items():
            assert torch.allclose(got[name].float(), t.float(), atol=1e-2 if src.name == "drafter" else 0), name
    fresh = _init_state(tiny_config(cache=b, model=model, output="unused", taps=(0, 2)))
    assert not torch.equal(fresh.drafter.state_dict()["fc.weight"], trained["fc.weight"])
    kw = dict(cache=b, model=model, steps=4, init_from=str(first))
    res = train(tiny_config(output=str(tmp_path / "next"), **kw), device="cpu")
    assert res.finished and json.loads((tmp_path / "next" / "config.json").read_text())["drafter"][
        "target_layer_ids"] == [0, 2]
    # cut and resumed: the resume continues its own weights and taps, with the uninterrupted run's losses
    assert _cut_and_resume_losses(tmp_path / "cut", kw, cut=2) == _steps_and_losses(tmp_path / "next")[1]


def test_init_from_refuses_a_drafter_that_does_not_fit(assets, tmp_path):
    from click.testing import CliRunner

    from cli.main import cli
    from dflash.drafter.config import DrafterConfig
    from dflash.drafter.export import export_drafter
    from dflash.drafter.model import DFlashDrafter

    model, a, _, _ = assets
    other_taps = tiny_cache(tmp_path / "taps", pathlib.Path(model), num_samples=6, taps=(0, 1, 3))
    dc = DrafterConfig(hidden_size=64, intermediate_size=64, target_layer_ids=(0, 2), num_target_layers=4,
                       mask_token_id=0, vocab_size=_vocab(model), num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=32, block_size=4)
    export_drafter(DFlashDrafter(dc), dc, tmp_path / "d")
    base = ["train", "--model", model, "--init-from", str(tmp_path / "d"), "--steps", "1"]
    r = CliRunner().invoke(cli, base + ["--cache", str(other_taps), "--output", str(tmp_path / "o1")])
    assert r.exit_code == 1 and "target_layer_ids" in r.output and "lacks taps [2]" in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1
    r = CliRunner().invoke(cli, base + ["--cache", a, "--output", str(tmp_path / "o2"), "--taps", "0,1"])
    assert r.exit_code == 1 and "taps" in r.output, r.output
    wide = DrafterConfig(**{**dc.to_json(), "hidden_size": 32, "target_layer_ids": (0, 2)})
    export_drafter(DFlashDrafter(wide), wide, tmp_path / "w")
    r = CliRunner().invoke(cli, ["train", "--model", model, "--init-from", str(tmp_path / "w"), "--cache", a,
                                 "--output", str(tmp_path / "o3")])
    assert r.exit_code == 1 and "hidden_size 32 != the run's 64" in r.output, r.output
    r = CliRunner().invoke(cli, ["train", "--model", model, "--init-from", str(tmp_path / "nothing"), "--cache", a,
                                 "--output", str(tmp_path / "o4")])
    assert r.exit_code == 1 and "not a dflash run folder" in r.output, r.output


def _vocab(model):
    from transformers import AutoConfig

    from dflash.target.load import text_config

    return int(text_config(AutoConfig.from_pretrained(model)).vocab_size)


# ---------------------------------------------------------------------------------------------- mixture sweeps


def test_mixture_sweep_trains_each_weighting_off_one_read_of_each_cache(assets, tmp_path):
    """A grid over cache_weights: each run equals the same run trained alone, and each sample any run uses is
    read from disk once: the bytes read are at most those of reading each used sample once (+5%)."""
    from dflash.cache import CacheReader
    from dflash.cache.mixed import MixedReader
    from dflash.sweep.mixture import plan_uses
    from dflash.sweep.runner import run_sweep
    from dflash.sweep.spec import spec_from_dict
    from dflash.train.checkpoint import PLAN_VERSION
    from dflash.train.loader import plan_costs
    from dflash.train.trainer import train

    model, a, b, _ = assets
    base = dict(num_layers=1, block_size=4, num_anchors=8, batch_tokens=200, lr=3e-3, warmup_ratio=0.1,
                log_every=1, save_every=2, num_readers=1, prefetch=2, intermediate_size=64, steps=6)
    out = tmp_path / "sw"
    spec = spec_from_dict({"base": base, "grid": {"cache_weights": [[3, 1], [1, 3]]}}, cache=a, extra_caches=(b,),
                          model=model, output=str(out))
    res = run_sweep(spec, output=out, device="cpu")
    assert res.groups == [["cache_weights3-1", "cache_weights1-3"]]
    rec = json.loads((out / "streams" / "group-0.json").read_text())["mixture"]
    assert rec["samples_read_from_disk"] == rec["unique_samples"] < rec["sample_uses"]
    for name, w in (("cache_weights3-1", (3, 1)), ("cache_weights1-3", (1, 3))):
        alone = tmp_path / f"alone{name}"
        train(tiny_config(cache=a, extra_caches=(b,), cache_weights=w, model=model, output=str(alone), steps=6,
                          shuffle_seed=0), device="cpu")
        assert _steps_and_losses(out / "runs" / name) == _steps_and_losses(alone)
    mixed = MixedReader([CacheReader(a), CacheReader(b)])
    cfgs = [spec.runs[0].config, spec.runs[1].config]
    costs = plan_costs(mixed.index.length, mixed.index.num_loss_tokens, plan_version=PLAN_VERSION)
    _, used = plan_uses(cfgs, [6, 6], index=mixed.index, counts=mixed.counts, costs=costs)
    for g in np.unique(np.concatenate(used)).tolist():
        mixed.read_many([g], taps=(0, 1, 2))
    assert res.bytes_read <= 1.05 * mixed.bytes_read, (res.bytes_read, mixed.bytes_read)


def test_run_threads_stops_every_stream_at_the_step_the_first_poll_decides():
    """terminate() asks stop() once per step for all threads, so both stop at one step (asked once per poll, a flag
    that turns on between two threads' polls of one step would stop them a step apart)."""
    from dflash.sweep.mixture import run_threads

    calls = []

    def stop():
        calls.append(1)
        return len(calls) >= 4

    def job(before, terminate):
        for s in range(10):
            before(s)
            if terminate():
                return s
        return None

    assert run_threads([job, job], stop=stop) == [3, 3]
    assert len(calls) == 4
