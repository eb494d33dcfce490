"""`dflash train --online` on the real SmolLM2-135M: the live target's taps must reproduce a cached run.

The cache is extracted in fp32 from the same model (and stored as bf16), so the online run (which computes the
taps in the cache's target dtype, fp32 here, in differently padded forward batches, and feeds them unrounded)
must give the same per-step losses as the cached run up to the bf16 storage rounding; and its loader must read
no hidden bytes. Measured on CPU: per-step losses agree to <= 7e-5 relative (tolerance 3e-4).
"""

import json

import numpy as np
import pytest
import torch

from dflash.train.metrics import read_metrics

NUM_CONVERSATIONS = 10
STEPS = 4


def _extract(smollm2_dir, d, storage: str, taps=None, **over):
    from dflash.data.assets import sharegpt_conversations
    from dflash.extract.driver import ExtractConfig
    from dflash.extract.launch import launch

    if not (d / "chats.jsonl").exists():
        lines = [json.dumps(c) for c in sharegpt_conversations(NUM_CONVERSATIONS)]
        (d / "chats.jsonl").write_text("\n".join(lines) + "\n")
    out = d / (f"cache_{storage}" + (f"_taps{'-'.join(map(str, taps))}" if taps else ""))
    cfg = ExtractConfig(model=str(smollm2_dir), data=(str(d / "chats.jsonl"),), output=str(out),
                        dtype="float32", max_length=96, batch_tokens=512, show_progress=False, device="cpu",
                        storage=storage, taps=taps, **over)
    launch(cfg, num_procs=1, echo=lambda *a, **k: None)
    return out


@pytest.fixture(scope="module")
def fp32_cache(tmp_path_factory, smollm2_dir):
    return str(smollm2_dir), _extract(smollm2_dir, tmp_path_factory.mktemp("online"), "bf16")


def _run(cache, model, out, *, online: bool, online_storage: str | None = None, taps=(1, 14, 27)):
    from dflash.train.config import TrainConfig
    from dflash.train.trainer import train

    cfg = TrainConfig(cache=str(cache), model=model, output=str(out), num_layers=1, block_size=4, num_anchors=8,
                      intermediate_size=128, mask_token_id=16, lr=3e-3, batch_tokens=256, steps=STEPS, seed=3,
                      log_every=1, save_every=100, num_readers=1, prefetch=2, online=online, taps=taps,
                      online_storage=online_storage)
    res = train(cfg, device="cpu")
    losses = [x for r in read_metrics(out) for x in r["step_losses"]]
    return res, losses


def test_online_matches_cached_run(fp32_cache, tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_NO_PROGRESS", "1")
    torch.set_num_threads(1)
    model, cache = fp32_cache
    cached, loss_c = _run(cache, model, tmp_path / "cached", online=False)
    online, loss_o = _run(cache, model, tmp_path / "online", online=True)
    assert len(loss_c) == len(loss_o) == STEPS
    print(f"cached {loss_c}\nonline {loss_o}")
    np.testing.assert_allclose(loss_o, loss_c, rtol=3e-4)
    assert cached.cache_bytes_read > 0
    assert online.cache_bytes_read == 0  # ids and masks only
    assert loss_c[0] != loss_c[-1]  # the drafter trains (the comparison is not of constants)


def test_online_taps_need_not_be_the_caches(fp32_cache, tmp_path, monkeypatch):
    """An online run takes only the token stream from its cache: from a cache of one cheap tap (layer 0: one
    layer of the target runs at extraction) it trains on taps (1, 14, 27) exactly as from a cache holding them.
    A cached run on that cache is refused, naming the taps it holds."""
    from dflash.errors import ConfigError

    monkeypatch.setenv("DFLASH_NO_PROGRESS", "1")
    torch.set_num_threads(1)
    model, cache = fp32_cache
    one_tap = _extract(model, cache.parent, "bf16", taps=(0,))
    _, loss_full = _run(cache, model, tmp_path / "full", online=True)
    res, loss_one = _run(one_tap, model, tmp_path / "one", online=True)
    assert loss_one == loss_full and len(loss_one) == STEPS
    assert json.loads((res.drafter_dir / "config.json").read_text())["dflash_config"]["target_layer_ids"] == [1, 14, 27]
    with pytest.raises(ConfigError, match=r"taps \[1, 14, 27\] are not in the cache; it holds taps \[0\]"):
        _run(one_tap, model, tmp_path / "cached", online=False)
    with pytest.raises(ConfigError, match="40 is out of range for a target with 30"):  # checked against the target
        _run(one_tap, model, tmp_path / "bad", online=True, taps=(1, 40))


def test_online_loader_reads_no_hidden(fp32_cache):
    from dflash.cache import CacheReader
    from dflash.train.loader import StreamingLoader, plan_epoch

    _, cache = fp32_cache
    outs = {}
    for read_hidden in (True, False):
        reader = CacheReader(cache)
        plan = plan_epoch(reader.index.length, seed=1, epoch=0, batch_tokens=256, world_size=1, grad_accum=1)
        with StreamingLoader(reader, plan, rank=0, start_step=0, taps=(1, 14), device=torch.device("cpu"),
                             dtype=torch.float32, num_readers=1, prefetch=2, read_hidden=read_hidden) as loader:
            mbs = list(loader)
        outs[read_hidden] = (mbs, reader.bytes_read)
        reader.close()
    (full, full_bytes), (ids_only, ids_bytes) = outs[True], outs[False]
    assert full_bytes > 0 and ids_bytes == 0
    assert len(full) == len(ids_only)
    for a, b in zip(full, ids_only):
        assert np.array_equal(a.sample_ids, b.sample_ids)
        assert torch.equal(a.input_ids_T, b.input_ids_T) and torch.equal(a.loss_mask_T, b.loss_mask_T)
        assert b.hidden_TKD.shape == (a.hidden_TKD.shape[0], 0, a.hidden_TKD.shape[2])


def test_online_taps_equal_cached_features(fp32_cache):
    """OnlineTaps.hidden on packed samples of mixed length == the fp32 cache's rows (padding never leaks)."""
    from dflash.cache import CacheReader
    from dflash.target.load import load_target
    from dflash.train.online import OnlineTaps

    model_dir, cache = fp32_cache
    reader = CacheReader(cache)
    idx = [3, 0, 5, 1]
    p = reader.read_many(idx, taps=(1, 14))
    model, _ = load_target(model_dir, device="cpu", dtype=torch.float32)
    taps = OnlineTaps(model, (1, 14), dtype=torch.float32, batch_tokens=128)  # forces several forward batches
    got = taps.hidden(torch.from_numpy(p.input_ids.astype(np.int64)), p.lengths)
    ref = p.hidden  # bf16: the cache stores bf16 bits of the fp32 extraction
    assert got.shape == ref.shape and got.dtype == torch.float32
    rel = float((got - ref.float()).norm() / ref.float().norm())
    same = float((got.to(torch.bfloat16) == ref).float().mean())
    print(f"online fp32 vs cached bf16 taps: relative error {rel:.2e}, bf16-identical {same:.4f}")
    assert rel < 4e-3   # bf16 rounding (2^-9)
    assert same > 0.99  # rounded to bf16 they are the cache's bits, up to fp32 noise at rounding ties
    reader.close()


@pytest.mark.parametrize("storage", ["fp8", "int4"])
def test_online_storage_gives_the_features_and_run_of_that_cache(fp32_cache, tmp_path, monkeypatch, storage):
    """--online-storage S: the live taps rounded through S's encode/decode are a cache of S's features (per token
    and tap: the forward batching does not matter), and the run trains as from that cache."""
    from dflash.cache import CacheReader
    from dflash.target.load import load_target
    from dflash.train.loader import MicroBatch
    from dflash.train.online import OnlineTaps

    monkeypatch.setenv("DFLASH_NO_PROGRESS", "1")
    torch.set_num_threads(1)
    model_dir, _ = fp32_cache
    cache = _extract(model_dir, tmp_path, storage)
    reader = CacheReader(cache)
    p = reader.read_many([3, 0, 5, 1], taps=(1, 14), dequantize=True)
    model, _ = load_target(model_dir, device="cpu", dtype=torch.float32)
    mb = MicroBatch(sample_ids=np.asarray(p.sample_ids), lengths=np.asarray(p.lengths),
                    input_ids_T=torch.from_numpy(p.input_ids.astype(np.int64)), loss_mask_T=torch.zeros(0),
                    hidden_TKD=torch.zeros(0))
    # decoded to bf16 as the reader's dequantize does (the loader decodes to the compute dtype the same way)
    filled = OnlineTaps(model, (1, 14), dtype=torch.float32, batch_tokens=128).fill(
        mb, torch.bfloat16, storages=[storage, None, storage])
    assert list(filled) == [storage, None]   # one entry per distinct storage, from one forward
    rounded, raw = filled[storage].hidden_TKD, filled[None].hidden_TKD
    ref = p.hidden
    same_rounded = float((rounded == ref).float().mean())
    same_raw = float((raw == ref).float().mean())
    print(f"{storage}: online rounded == cache {same_rounded:.4f}, unrounded == cache {same_raw:.4f}")
    assert same_rounded > 0.99 and same_raw < 0.5  # the rounding is the cache's, and it is not a no-op
    reader.close()
    _, loss_c = _run(cache, model_dir, tmp_path / "cached", online=False)
    _, loss_r = _run(cache, model_dir, tmp_path / "rounded", online=True, online_storage=storage)
    _, loss_u = _run(cache, model_dir, tmp_path / "unrounded", online=True)
    print(f"cached {loss_c}\nrounded {loss_r}\nunrounded {loss_u}")
    gap_r = max(abs(a - b) / abs(b) for a, b in zip(loss_r, loss_c))
    gap_u = max(abs(a - b) / abs(b) for a, b in zip(loss_u, loss_c))
    assert gap_r < 3e-4 and gap_r < gap_u / 3


def test_online_compiled_layers_give_the_taps_in_one_graph(fp32_cache):
    """online_compile: the live target's decoder layers under torch.compile give the eager taps up to float
    rounding, over forward batches of several shapes, from one graph shared by every layer (a graph per layer or
    per shape would cost a compile each, and the eager launches it removes are the online step's host cost)."""
    from torch._dynamo.utils import counters

    from dflash.cache import CacheReader
    from dflash.target.load import load_target
    from dflash.train.online import OnlineTaps

    model_dir, cache = fp32_cache
    reader = CacheReader(cache)
    p = reader.read_many([3, 0, 5, 1, 7], taps=(1, 14))
    reader.close()
    ids, lengths = torch.from_numpy(p.input_ids.astype(np.int64)), p.lengths
    model, _ = load_target(model_dir, device="cpu", dtype=torch.float32)
    eager = OnlineTaps(model, (1, 14), dtype=torch.float32, batch_tokens=128).hidden(ids, lengths)
    graphs = counters["stats"]["unique_graphs"]
    compiled = OnlineTaps(model, (1, 14), dtype=torch.float32, batch_tokens=128, compile_layers=True)
    assert all("forward" in layer.__dict__ for layer in compiled.tapped._kept_layers)
    got = compiled.hidden(ids, lengths)   # several forward batches: shapes (B, S) differ
    assert counters["stats"]["unique_graphs"] - graphs == 1
    assert float((got - eager).abs().max() / eager.abs().max()) < 1e-5


def test_online_storage_needs_online_and_a_storage():
    from dflash.errors import ConfigError
    from dflash.train.config import TrainConfig

    kw = dict(cache="c", model="m", output="o")
    with pytest.raises(ConfigError, match="needs --online"):
        TrainConfig(**kw, online_storage="fp8")
    with pytest.raises(ConfigError, match="fp9"):
        TrainConfig(**kw, online=True, online_storage="fp9")
    assert TrainConfig(**kw, online=True, online_storage="int4").online_storage == "int4"
    with pytest.raises(ConfigError, match="online_compile='yes': choose auto, on, off"):
        TrainConfig(**kw, online=True, online_compile="yes")
    # float rounding only: a run may resume with the target compiled or not, unlike with another storage
    from dflash.train.config import check_resume_compatible

    saved = TrainConfig(**kw, online=True, online_storage="fp8").to_json()
    check_resume_compatible(saved, TrainConfig(**kw, online=True, online_storage="fp8", online_compile="on"))
    with pytest.raises(ConfigError, match="online_storage"):
        check_resume_compatible(saved, TrainConfig(**kw, online=True, online_storage="bf16"))


def test_forward_index_maps_pin_packed_positions_and_pads():
    from dflash.train.online import forward_index_maps

    # samples of lengths 3, 1, 2 packed at 10, 4, 20 (a forward batch's rows come in its own order)
    src, real = forward_index_maps(np.array([10, 4, 20]), np.array([3, 1, 2]), pad_src=99)
    assert src.tolist() == [[10, 11, 12], [4, 99, 99], [20, 21, 99]]
    assert real.tolist() == [0, 1, 2, 3, 6, 7]
    assert src.ravel()[real].tolist() == [10, 11, 12, 4, 20, 21]
    assert src.dtype == real.dtype == np.int64


def test_online_sweep_group_rounds_each_run_through_its_own_storage(fp32_cache, tmp_path, monkeypatch):
    """A sweep group of online runs that differ only in online_storage shares one live target (one forward per
    micro-batch) and gives each run exactly the losses of `dflash train --online --online-storage` alone."""
    from dflash.sweep.runner import run_sweep
    from dflash.sweep.spec import spec_from_dict

    monkeypatch.setenv("DFLASH_NO_PROGRESS", "1")
    torch.set_num_threads(1)
    model, cache = fp32_cache
    base = dict(num_layers=1, block_size=4, num_anchors=8, intermediate_size=128, mask_token_id=16, lr=3e-3,
                batch_tokens=256, steps=STEPS, seed=3, log_every=1, save_every=100, num_readers=1, prefetch=2,
                online=True, taps=[1, 14, 27])
    out = tmp_path / "sweep"
    spec = spec_from_dict({"base": base, "runs": [{"name": "fp8", "online_storage": "fp8"}, {"name": "raw"}]},
                          cache=str(cache), model=model, output=str(out))
    res = run_sweep(spec, output=out, device="cpu")
    assert [len(g) for g in json.loads((out / "sweep.json").read_text())["groups"]] == [2]   # one stream
    assert res.bytes_read == 0
    for name, storage in (("fp8", "fp8"), ("raw", None)):
        _, alone = _run(cache, model, tmp_path / f"alone_{name}", online=True, online_storage=storage)
        assert [x for r in read_metrics(out / "runs" / name) for x in r["step_losses"]] == alone
    fp8 = [x for r in read_metrics(out / "runs" / "fp8") for x in r["step_losses"]]
    raw = [x for r in read_metrics(out / "runs" / "raw") for x in r["step_losses"]]
    assert fp8 != raw   # the rounding reached each run


def test_extract_compile_layers_gives_the_eager_cache(fp32_cache, tmp_path):
    """`dflash extract --compile-layers on`: the target's decoder layers under torch.compile write the cache the
    eager layers write, up to float rounding seen through bf16 storage (same samples, tokens and loss masks)."""
    from dflash.cache import CacheReader

    model_dir, eager_cache = fp32_cache
    out = _extract(model_dir, tmp_path, "bf16", compile_layers="on")  # the same conversations, layers compiled
    a, b = CacheReader(eager_cache), CacheReader(out)
    ids = list(range(len(a)))
    assert len(b) == len(a)
    pa, pb = a.read_many(ids), b.read_many(ids)
    a.close(), b.close()
    np.testing.assert_array_equal(pa.input_ids, pb.input_ids)
    np.testing.assert_array_equal(pa.loss_mask, pb.loss_mask)
    ha, hb = pa.hidden.view(torch.bfloat16).float(), pb.hidden.view(torch.bfloat16).float()
    # fp32 differences of ~1e-6 relative flip at most an ulp of bf16 (2^-8 relative) here and there
    assert float((ha - hb).abs().max() / ha.abs().max()) < 1e-2
    assert float((ha != hb).float().mean()) < 0.05
