"""bench_peer at 10x the samples, across GPU sessions: the presets, SpecForge's segments (start-up, training to
the last kept checkpoint, work lost to the cut), when a run is stopped before its limit, z-lab's per-drafter runs
as one record, the training set rebuilt on a fresh machine, and SpecForge's tokenization probe in shards."""

import argparse
import importlib.util
import pathlib
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "peer"))

import data as peer_data  # noqa: E402
import env as peer_env  # noqa: E402
import recipe as peer_recipe  # noqa: E402


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_peer_scale_under_test", ROOT / "benchmarks" / "bench_peer.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_scale_preset_and_its_checks(bench):
    a = bench.parse_args(["--scale", "x10"])
    assert (a.train_prompts, a.dflash_storage, a.specforge_seeds, a.dflash_seeds) == (12000, "fp8", 1, 3)
    assert list(a.dflash_variants) == ["sequence", "fullblocks", "steps8"] and a.drop_train_cache
    assert a.specforge_save_interval % a.seqs_per_step == 0
    assert bench.parse_args([]).dflash_storage == "bf16"   # the 1,175-sample run's storage stays the default
    assert bench.parse_args(["--scale", "x10", "--dflash-storage", "int4"]).dflash_storage == "int4"
    with pytest.raises(SystemExit):
        bench.parse_args(["--specforge-save-interval", "12"])   # not a multiple of 8 sequences a step
    with pytest.raises(SystemExit):
        bench.parse_args(["--tiny", "--scale", "x10"])


def test_segment_of_a_cut_a_finished_and_a_never_started_call(bench):
    cut = {"wall_s": 520.0, "timed_out": True, "training_started_s": 40.0,
           "checkpoints_saved": [{"s": 100.0, "checkpoint": "epoch_0_step_480"}, {"s": 460.0, "checkpoint": "x"}]}
    assert bench.segment_record(cut, start_step=0, end_step=3360, card="H") == {
        "start_step": 0, "end_step": 3360, "startup_s": 40.0, "train_s": 420.0, "lost_s": 60.0, "wall_s": 520.0,
        "finished": False, "card": "H"}
    done = {"wall_s": 300.0, "timed_out": False, "training_started_s": 55.0, "checkpoints_saved": []}
    assert bench.segment_record(done, start_step=3360, end_step=5000, card="H")["train_s"] == 245.0
    never = {"wall_s": 30.0, "timed_out": True, "training_started_s": None}
    seg = bench.segment_record(never, start_step=480, end_step=480, card="H")
    assert (seg["end_step"], seg["startup_s"], seg["train_s"]) == (480, 30.0, 0.0)


def test_a_run_stops_right_after_the_last_checkpoint_before_its_limit(bench, tmp_path):
    w = bench.LogWatch(tmp_path / "none.log", tmp_path, 0.0)
    w.stop()
    assert not w.should_stop(520)
    w.started_s, w.saves = 40.0, [{"s": 100.0}]
    assert not w.should_stop(520)                  # the next one at ~169 s
    w.saves.append({"s": 450.0})
    assert w.should_stop(520) and not w.should_stop(900)   # the next one at ~852 s
    assert not w.should_stop(None)
    w.cut_after_saves = 2
    assert w.should_stop(None)


def test_log_watch_stamps_training_and_keeps_only_the_newest_checkpoint(bench, tmp_path):
    for name in ("epoch_0_step_8", "epoch_0_step_16"):
        (tmp_path / name).mkdir()
    logf = tmp_path / "sf.log"
    logf.write_text("Starting training from epoch 0, step 0\nSaved checkpoint to /x/epoch_0_step_8\n"
                    "Saved checkpoint to /x/epoch_0_step_16\n")
    w = bench.LogWatch(logf, tmp_path, 0.0)
    ev = w.stop()
    assert ev["training_started_s"] is not None
    assert [s["checkpoint"] for s in ev["checkpoints_saved"]] == ["epoch_0_step_8", "epoch_0_step_16"]
    assert sorted(p.name for p in tmp_path.glob("epoch_*")) == ["epoch_0_step_16"]
    # the final save (epoch 2) at the step of a periodic one (epoch 1) is being written when the periodic one is
    # reported: it stays
    (tmp_path / "epoch_1_step_24").mkdir()
    (tmp_path / "epoch_2_step_24").mkdir()
    logf.write_text(logf.read_text() + "Saved checkpoint to /x/epoch_1_step_24\n")
    w = bench.LogWatch(logf, tmp_path, 0.0)
    w.stop()
    assert sorted(p.name for p in tmp_path.glob("epoch_*")) == ["epoch_1_step_24", "epoch_2_step_24"]


def test_newest_complete_checkpoint(bench, tmp_path):
    for name, full in (("epoch_0_step_8", True), ("epoch_0_step_16", True), ("epoch_1_step_24", False)):
        (tmp_path / name).mkdir()
        if full:
            (tmp_path / name / "training_state.pt").write_bytes(b"x")
            (tmp_path / name / "model.safetensors").write_bytes(b"x")
    assert bench.latest_specforge_checkpoint(tmp_path).name == "epoch_0_step_16"   # step 24 is half written
    assert bench.latest_specforge_checkpoint(tmp_path / "absent") is None


def test_pack_and_restore_a_checkpoint(bench, tmp_path):
    ck = tmp_path / "run" / "epoch_0_step_16"
    ck.mkdir(parents=True)
    (ck / "training_state.pt").write_bytes(np.arange(300_000, dtype=np.float32).tobytes())
    (ck / "model.safetensors").write_bytes(b"w" * 1000)
    m = bench.pack_checkpoint(ck, tmp_path / "pack", work=tmp_path)
    assert m["step"] == 16 and m["parts"] >= 1
    with pytest.raises(SystemExit, match="micro-step 16, but"):
        bench.restore_checkpoint(tmp_path / "pack", tmp_path / "new", 8)
    r = bench.restore_checkpoint(tmp_path / "pack", tmp_path / "new", 16)
    assert r["checkpoint"] == "epoch_0_step_16"
    assert (tmp_path / "new" / "epoch_0_step_16" / "training_state.pt").read_bytes() == \
        (ck / "training_state.pt").read_bytes()
    assert bench.latest_specforge_checkpoint(tmp_path / "new").name == "epoch_0_step_16"


def test_zlab_runs_merge_and_the_rebuilt_training_set_must_match(bench, tmp_path):
    z = bench.merge_zlab({"dflash": {"limit": 10, "drafters": {"dflash": {"a": 1}}},
                          "specforge": {"limit": 10, "drafters": {"specforge": {"b": 2}}}})
    assert z == {"limit": 10, "drafters": {"dflash": {"a": 1}, "specforge": {"b": 2}}}
    for f in bench.TRAINING_FILES:
        (tmp_path / f).write_text(f)
    data = {}
    bench.same_training_set(tmp_path, data, None)
    again = {}
    bench.same_training_set(tmp_path, again, {"sha256": data["sha256"]})
    (tmp_path / "train_dflash.jsonl").write_text("other")
    with pytest.raises(SystemExit, match="differs .*train_dflash.jsonl"):
        bench.same_training_set(tmp_path, {}, {"sha256": data["sha256"]})


@pytest.mark.slow
def test_probe_in_shards_gives_the_one_process_result(bench, smollm2_dir, tmp_path, monkeypatch):
    peers = peer_env.unpack(dest=tmp_path / "peer") if all(
        (peer_env.PEERS / n).is_file() for n in (peer_env.SPECFORGE_TAR, peer_env.ZLAB_TAR)) else None
    if peers is None:
        pytest.skip("peer snapshots not on this machine")
    peer_env.install(peer_env.missing_modules(), wheels=None)
    convs = peer_data.from_sharegpt(3, max_chars=300)
    peer_data.write_both(convs, dflash_path=tmp_path / "d.jsonl", specforge_path=tmp_path / "s.jsonl")
    args = argparse.Namespace(peers=peers, cpu=True, verbose=False)
    recipe = peer_recipe.PeerRecipe(max_length=512)
    one, lr1 = bench.specforge_probe(args, model=str(smollm2_dir), data=tmp_path / "s.jsonl", out=tmp_path / "a.npz",
                                     steps=4, recipe=recipe)
    monkeypatch.setattr(bench, "PROBE_SHARD", 2)
    sharded, lr3 = bench.specforge_probe(args, model=str(smollm2_dir), data=tmp_path / "s.jsonl",
                                         out=tmp_path / "b.npz", steps=4, recipe=recipe)
    assert sorted(sharded) == sorted(one) == list(range(3))   # shards of 2 and 1
    for i in one:
        assert np.array_equal(one[i][0], sharded[i][0]) and np.array_equal(one[i][1], sharded[i][1])
    assert np.array_equal(lr1, lr3) and len(lr1) == 4
    assert not list(tmp_path.glob("*.shard*"))


def test_dflash_stages_name_every_training_run_before_specforge(bench):
    a = bench.parse_args(["--scale", "x10"])
    assert bench.dflash_stages(a) == ["f_dflash", "f_dflash_seed1", "f_dflash_seed2", "f_dflash_sequence",
                                      "f_dflash_fullblocks", "f_dflash_steps8"]
    assert a.dflash_time_epochs == 3   # its run comes after SpecForge's, when needed
    assert bench.dflash_stages(bench.parse_args(["--tiny"])) == ["f_dflash", "f_dflash_seed1"]


def test_the_longer_run_trains_only_when_the_same_steps_run_ends_below_specforge(bench):
    curve = [{"step": 100, "wall_s": 50.0, "tau": 1.3}, {"step": 200, "wall_s": 90.0, "tau": 1.45}]

    def result(specforge_tau):
        return {"dflash": {"heldout": curve}, "eval": {"specforge": {"mtbench": {"tau": specforge_tau}}}}

    assert bench.long_run_needed(result(1.46))          # never reached: only a longer schedule gives the ratio
    assert not bench.long_run_needed(result(1.45))      # reached at step 200: the ratio comes from stage f
    assert not bench.long_run_needed(result(1.2))
    assert not bench.long_run_needed({"dflash": {"heldout": curve}})   # SpecForge not finished: not known yet
    assert not bench.long_run_needed({})


def test_a_late_specforge_finish_leaves_its_load_check_and_zlab_loop_to_the_next_call(bench):
    """run_h200.sh peerx: the call's limit is the deadline + 40 s; the load check and z-lab's loop take ~70-80 s."""
    assert bench.room_after_specforge(530.0, 400.0)
    assert bench.room_after_specforge(530.0, 470.0)
    assert not bench.room_after_specforge(530.0, 471.0)
    assert not bench.room_after_specforge(290.0, 300.0)        # a session's last call, shortened by LIMIT
    assert bench.room_after_specforge(None, 10_000.0)         # no deadline (CPU, or a call without one)


def test_a_resumed_call_must_keep_the_recipe(bench):
    a = bench.parse_args(["--scale", "x10", "--epochs", "1"])
    earlier = {"config": {"scale": "x10", "epochs": 1, "train_prompts": 12000, "dflash_storage": "fp8"}}
    assert bench.changed_recipe(earlier, a) == {}
    assert bench.changed_recipe(earlier, bench.parse_args(["--scale", "x10"])) == {"epochs": (1, 2)}
    assert bench.changed_recipe(None, a) == {}
