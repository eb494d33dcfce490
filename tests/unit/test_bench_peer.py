"""The pure logic of benchmarks/bench_peer.py (issue 15): the token-id / loss-mask agreement check, run on real
SmolLM2 conversations tokenized by dflash and by SpecForge's own parser (loaded from the snapshot, no extra
packages); the recipe mapping (one drafter config for both trainers, loadable by z-lab's DFlashDraftModel with
dflash's tensor names); step matching; the two lr schedules; and the two trainers' losses, SpecForge's own
OnlineDFlashModel against dflash's micro-batch loss on the same weights and anchors."""

import importlib
import importlib.util
import pathlib
import sys
import types
import warnings

import numpy as np
import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "peer"))

import data as peer_data  # noqa: E402
import env as peer_env  # noqa: E402
import recipe as peer_recipe  # noqa: E402

SMOLLM2 = dict(hidden_size=576, num_hidden_layers=30, vocab_size=49152)


@pytest.fixture(scope="module")
def peers(tmp_path_factory):
    # the MIT snapshots live in the project's shared folder beside the checkout, not in the repository (never
    # copied in): a checkout without that folder cannot run the tests that read the peers' own code
    missing = [n for n in (peer_env.SPECFORGE_TAR, peer_env.ZLAB_TAR) if not (peer_env.PEERS / n).is_file()]
    if missing:
        pytest.skip(f"peer snapshots not on this machine: {', '.join(missing)} under {peer_env.PEERS}")
    return peer_env.unpack(dest=tmp_path_factory.mktemp("peer"))


def _load_by_path(name: str, path: pathlib.Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _package(name: str, path: pathlib.Path) -> None:
    """`name` in sys.modules as a bare package over `path`: its modules import, its __init__ does not run."""
    pkg = types.ModuleType(name)
    pkg.__path__ = [str(path)]
    sys.modules[name] = pkg


@pytest.fixture(scope="module")
def specforge_parser(peers):
    """SpecForge's GeneralParser and its 'qwen' template: specforge/data/{parse,template}.py as a package of their
    own, without specforge/__init__ (which imports sglang, yunchang, datasets, triton)."""
    _package("sf_data_under_test", peers["specforge"] / "specforge" / "data")
    parse = importlib.import_module("sf_data_under_test.parse")
    template = importlib.import_module("sf_data_under_test.template")
    return parse.GeneralParser, template.TEMPLATE_REGISTRY.get("qwen")


def _ids(*xs):
    return np.asarray(xs, np.int32)


def test_compare_keeps_only_identical_samples():
    mask = np.asarray([0, 0, 1, 1], np.uint8)
    ours = {0: (_ids(1, 2, 3, 4), mask), 1: (_ids(1, 2, 3, 4), mask), 2: (_ids(1, 2, 3, 4), mask),
            3: (_ids(1, 2, 3, 4, 5, 6), np.asarray([0, 0, 1, 1, 1, 1], np.uint8)), 5: (_ids(1, 2, 3), mask[:3])}
    theirs = {0: (_ids(1, 2, 3, 4), mask), 1: (_ids(1, 2, 9, 4), mask), 2: (_ids(1, 2, 3, 4), np.asarray([0, 1, 1, 1])),
              3: ours[3], 4: (_ids(7), np.asarray([1])), 5: (_ids(1, 2, 3), mask[:3])}
    a = peer_data.compare_tokenizations(ours=ours, theirs=theirs, max_length=5, min_loss_tokens=2)
    assert a.kept == (0,)
    assert a.dropped == {"dflash_skipped": 1, "ids_differ": 1, "mask_differs": 1, "over_length": 1,
                         "few_loss_tokens": 1}
    assert (a.num_candidates, a.ids_equal, a.masks_equal, a.masks_eot_newline_only) == (6, 4, 3, 0)
    assert a.mismatches[0] == {"index": 1, "differs": "ids", "position": 2, "len_dflash": 4, "len_specforge": 4,
                               "dflash": 3, "specforge": 9}
    assert a.mismatches[1]["differs"] == "loss_mask" and a.mismatches[1]["position"] == 1
    assert not a.to_json()["ids_all_agree"]


def test_newline_after_end_of_turn_is_the_one_tolerated_mask_difference():
    """SpecForge's 'qwen' end-of-turn string is '<|im_end|>\\n': its mask also covers the newline token after
    <|im_end|> (id 2 here). That sample is kept (dflash trains on SpecForge's mask); any other difference drops."""
    ids = _ids(5, 6, 7, 2, 198)
    ours = np.asarray([0, 0, 1, 1, 0], np.uint8)
    newline = np.asarray([0, 0, 1, 1, 1], np.uint8)
    other = np.asarray([0, 1, 1, 1, 0], np.uint8)
    a = peer_data.compare_tokenizations(ours={0: (ids, ours), 1: (ids, ours), 2: (ids, ours)},
                                        theirs={0: (ids, newline), 1: (ids, other), 2: (ids, ours)}, max_length=10,
                                        min_loss_tokens=1, eot_ids=frozenset({2}))
    assert a.kept == (0, 2) and a.masks_eot_newline_only == 1 and a.masks_equal == 1
    assert a.dropped["mask_differs"] == 1
    b = peer_data.compare_tokenizations(ours={0: (ids, ours)}, theirs={0: (ids, newline)}, max_length=10,
                                        min_loss_tokens=1, eot_ids=frozenset())
    assert b.kept == () and b.dropped["mask_differs"] == 1


def test_length_mismatch_is_an_id_difference():
    m = np.ones(3, np.uint8)
    a = peer_data.compare_tokenizations(ours={0: (_ids(1, 2, 3), m)}, theirs={0: (_ids(1, 2), m[:2])},
                                        max_length=10, min_loss_tokens=1)
    assert a.kept == () and a.mismatches[0]["position"] == 2 and a.mismatches[0]["specforge"] is None


def test_read_probe_records_are_views_of_one_load(tmp_path):
    """specforge_probe.py's npz read back: record i is ids/masks[offsets[i]:offsets[i + 1]], and every record is a
    view of the one array loaded (an NpzFile reads the whole array again at each z[key]: per record, 12,000
    records of the 10x run held ~130 GB)."""
    ids, masks = np.arange(7, dtype=np.int32), np.array([0, 1, 1, 0, 1, 1, 1], np.uint8)
    np.savez(tmp_path / "p.npz", ids=ids, masks=masks, offsets=np.array([0, 3, 3, 7]), lr=np.array([0.5, 1.0]))
    toks, lr = peer_data.read_probe(tmp_path / "p.npz")
    assert sorted(toks) == [0, 1, 2] and lr.tolist() == [0.5, 1.0]
    assert toks[0][0].tolist() == [0, 1, 2] and toks[1][0].size == 0 and toks[2][1].tolist() == [0, 1, 1, 1]
    assert toks[0][0].base is toks[2][0].base is not None and toks[0][1].base is toks[2][1].base is not None


def test_real_conversations_tokenize_the_same_both_ways(smollm2_dir, specforge_parser, tmp_path):
    """dflash's tokenization (as `dflash extract` does it) and SpecForge's parser agree on real ShareGPT
    conversations with the explicit system turn; without it they differ (SmolLM2's default system prompt)."""
    from transformers import AutoTokenizer

    parser_cls, template = specforge_parser
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    convs = peer_data.from_sharegpt(6, max_chars=300)
    assert len(convs) == 6
    peer_data.write_both(convs, dflash_path=tmp_path / "d.jsonl", specforge_path=tmp_path / "s.jsonl")
    ours = peer_data.dflash_tokenization(tmp_path / "d.jsonl", tok)
    parser = parser_cls(tok, template)
    theirs = {}
    for i, c in enumerate(convs):
        ids, mask = parser.parse(c, 2048)
        theirs[i] = (ids.numpy(), mask.numpy())
    from dflash.data import end_of_turn_ids

    a = peer_data.compare_tokenizations(ours=ours, theirs=theirs, max_length=2048, min_loss_tokens=1,
                                        eot_ids=end_of_turn_ids(tok))
    assert a.to_json()["ids_all_agree"], a.mismatches
    assert a.masks_eot_newline_only == 6 and a.kept == tuple(range(6))   # one assistant turn: one extra newline
    assert all(int(theirs[i][1].sum()) == int(ours[i][1].sum()) + 1 for i in range(6))
    # the check can fail: without the system turn dflash renders SmolLM2's own default system prompt
    bare = [c[1:] for c in convs]
    peer_data.write_both(bare, dflash_path=tmp_path / "d2.jsonl", specforge_path=tmp_path / "s2.jsonl")
    ours2 = peer_data.dflash_tokenization(tmp_path / "d2.jsonl", tok)
    theirs2 = {i: tuple(x.numpy() for x in parser.parse(c, 2048)) for i, c in enumerate(bare)}
    b = peer_data.compare_tokenizations(ours=ours2, theirs=theirs2, max_length=2048, min_loss_tokens=1)
    assert b.ids_equal == 0 and b.dropped["ids_differ"] == 6


def test_committed_whole_conversations_tokenize_the_same_both_ways(smollm2_dir, specforge_parser, tmp_path):
    """The GPU run's data: whole regenerated conversations (several assistant turns) from the committed quality
    set. Every assistant turn adds exactly one tolerated mask difference (its newline after <|im_end|>)."""
    from transformers import AutoTokenizer

    from dflash.data import end_of_turn_ids

    committed = sorted((ROOT / "benchmarks" / "assets" / "quality").glob("sharegpt_whole-*.jsonl.gz"))
    convs = peer_data.from_regenerated_conversations([str(p) for p in committed], 8)
    assert len(convs) == 8 and all(c[0]["role"] == "system" for c in convs)
    turns = [sum(m["role"] == "assistant" for m in c) for c in convs]
    assert max(turns) > 1, turns   # whole conversations, not first turns
    parser_cls, template = specforge_parser
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    peer_data.write_both(convs, dflash_path=tmp_path / "d.jsonl", specforge_path=tmp_path / "s.jsonl")
    ours = peer_data.dflash_tokenization(tmp_path / "d.jsonl", tok)
    parser = parser_cls(tok, template)
    theirs = {i: tuple(x.numpy() for x in parser.parse(c, 4096)) for i, c in enumerate(convs)}
    a = peer_data.compare_tokenizations(ours=ours, theirs=theirs, max_length=4096, min_loss_tokens=1,
                                        eot_ids=end_of_turn_ids(tok))
    assert a.to_json()["ids_all_agree"], a.mismatches
    assert a.kept == tuple(range(8))
    assert [int(theirs[i][1].sum()) - int(ours[i][1].sum()) for i in range(8)] == turns


def test_regenerated_conversation_reader_passes_over_broken_ones(tmp_path):
    import json

    recs = [{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                          {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]},
            {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": ""}]},
            {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
                          {"role": "assistant", "content": "c"}]},
            {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "e"},
                          {"role": "assistant", "content": "f"}]}]
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    convs = peer_data.from_regenerated_conversations([str(path)], 10)
    assert [[m["content"] for m in c] for c in convs] == [[peer_data.SYSTEM_PROMPT, "a", "b", "c", "d"],
                                                          [peer_data.SYSTEM_PROMPT, "e", "f"]]
    assert len(peer_data.from_regenerated_conversations([str(path)], 1)) == 1


def test_one_drafter_config_loads_in_zlab_with_dflash_names(peers):
    from transformers import Qwen3Config

    from dflash.drafter.config import DrafterConfig
    from dflash.drafter.model import DFlashDrafter

    recipe = peer_recipe.PeerRecipe(num_layers=2, mask_token_id=16)
    tcfg = peer_recipe.train_config(recipe, cache="c", model="m", output="o", steps=10, batch_tokens=4096)
    dc = peer_recipe.drafter_config(recipe, target_config=SMOLLM2, train_cfg=tcfg)
    zlab = peer_env.load_zlab_model(peers["zlab"])
    # the taps dflash extracts by default (5, z-lab's rule), also for a 2-layer drafter: dflash train uses them all
    assert list(dc.target_layer_ids) == zlab.build_target_layer_ids(30, 5) == [1, 8, 14, 20, 27]
    assert (dc.num_attention_heads, dc.num_key_value_heads, dc.head_dim, dc.rope_theta) == (9, 3, 64, 1e5)
    hf = dc.to_hf_config()
    assert DrafterConfig.from_hf_config(hf) == dc
    z = zlab.DFlashDraftModel(Qwen3Config(**hf))
    assert z.block_size == 16 and z.mask_token_id == 16 and z.target_layer_ids == list(dc.target_layer_ids)
    ours = {k: tuple(v.shape) for k, v in DFlashDrafter(dc).state_dict().items()}
    theirs = {k: tuple(v.shape) for k, v in z.state_dict().items() if "rotary_emb" not in k}
    assert ours == theirs


def test_specforge_args_carry_the_recipe():
    r = peer_recipe.PeerRecipe(seqs_per_step=4, epochs=2, lr=3e-4)
    a = peer_recipe.specforge_args(r, target="T", draft_config="D", data="X", output="O", cache="C")
    flags = dict(zip(a[::2], a[1::2]))
    assert flags["--target-model-backend"] == "hf" and flags["--mask-token-id"] == "16"
    assert flags["--num-anchors"] == "512" and flags["--loss-decay-gamma"] == "7" and flags["--block-size"] == "16"
    assert flags["--batch-size"] == "1" and flags["--accumulation-steps"] == "4" and flags["--num-epochs"] == "2"
    assert flags["--learning-rate"] == "0.0003" and flags["--warmup-ratio"] == "0.04"
    assert peer_recipe.specforge_steps(10, r) == 2 * 3
    with pytest.raises(ValueError, match="seqs_per_step"):
        peer_recipe.PeerRecipe(seqs_per_step=0)


def test_matched_budget_gives_specforge_steps_per_epoch():
    from dflash.train.loader import plan_epoch

    lengths = np.random.default_rng(0).integers(40, 400, size=50)
    for steps in (5, 7, 13):
        b = peer_recipe.match_batch_tokens(lengths, steps_per_epoch=steps, seed=0)
        n = plan_epoch(lengths, seed=0, epoch=0, batch_tokens=b, world_size=1, grad_accum=1).num_steps
        n_less = plan_epoch(lengths, seed=0, epoch=0, batch_tokens=b - 1, world_size=1, grad_accum=1).num_steps
        assert n <= steps < n_less
    with pytest.raises(ValueError, match="only 50 samples"):
        peer_recipe.match_batch_tokens(lengths, steps_per_epoch=51, seed=0)


@pytest.mark.parametrize("total", [100, 500])
def test_lr_schedules_agree(peers, total):
    """SpecForge's CosineAnnealingWarmupLR (its file, loaded alone) and dflash's lr_factor: same warmup, and the
    cosine within 0.1% of the peak (SpecForge's cosine starts one step late)."""
    sf = _load_by_path("sf_lr_under_test", peers["specforge"] / "specforge" / "lr_scheduler.py")
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([p], lr=6e-4)
    sched = sf.CosineAnnealingWarmupLR(opt, total_steps=total, warmup_steps=int(0.04 * total))
    theirs = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch's get_lr-inside-step note about SpecForge's scheduler
        for _ in range(total):
            theirs.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
    ours = [6e-4 * f for f in peer_recipe.dflash_lr_factors(total_steps=total, warmup_ratio=0.04)]
    warm = int(0.04 * total)
    assert theirs[:warm] == pytest.approx(ours[:warm], rel=1e-12)
    assert max(abs(a - b) for a, b in zip(theirs, ours)) / 6e-4 < 1e-3


def test_stubs_and_unpack(peers):
    assert (peers["specforge"] / "scripts" / "train_dflash.py").is_file()
    assert (peers["zlab"] / "dflash" / "model.py").is_file()
    gpu = {s["module"] for s in peer_env.stubs_report(cpu=False)}
    cpu = {s["module"] for s in peer_env.stubs_report(cpu=True)}
    assert "sglang.srt.server_args" in gpu and "specforge.core.loss" not in gpu and "specforge.core.loss" in cpu
    assert all(s["reason"] for s in peer_env.stubs_report(cpu=True))


@pytest.fixture(scope="module")
def bench():
    return _load_by_path("bench_peer_under_test", ROOT / "benchmarks" / "bench_peer.py")


def test_summary_numbers_and_checks(bench):
    """The issue's top-level numbers: taus per eval set, z-lab loop tau (mean over the sets), and the time ratio
    taken at dflash's first held-out tau at or above SpecForge's final MT-Bench tau."""
    ev = {"dflash": {"mtbench": {"tau": 1.50}, "humaneval": {"tau": 1.40}},
          "specforge": {"mtbench": {"tau": 1.45}, "humaneval": {"tau": 1.42}}}
    z = {"drafters": {"dflash": {"loads_cleanly": True, "mtbench": {"tau": 1.5}, "humaneval": {"tau": 1.3}},
                      "specforge": {"loads_cleanly": True, "mtbench": {"tau": 1.4}, "humaneval": {"tau": 1.4}}}}
    r = {"eval": ev, "zlab": z, "specforge": {"run": {"wall_s": 100.0}},
         "dflash": {"heldout": [{"wall_s": 20.0, "step": 5, "tau": 1.2}, {"wall_s": 40.0, "step": 10, "tau": 1.46},
                                {"wall_s": 60.0, "step": 15, "tau": 1.5}]}}
    bench.summarise(r)
    assert r["tau_dflash_mtbench"] == 1.50 and r["tau_specforge_humaneval"] == 1.42
    assert r["zlab_loop_tau_dflash"] == pytest.approx(1.4) and r["zlab_loop_tau_specforge"] == pytest.approx(1.4)
    assert r["time_to_peer_tau_ratio"] == pytest.approx(0.4)
    assert r["checks"] == {"mtbench_dflash_ge_specforge_minus_1pct": True,
                           "humaneval_dflash_ge_specforge_minus_1pct": False,   # 1.40 < 0.99 * 1.42
                           "time_to_peer_tau_le_half": True, "both_load_in_zlab_cleanly": True}
    r["dflash"]["heldout"] = [{"wall_s": 20.0, "step": 5, "tau": 1.2}]
    bench.summarise(r)
    assert r["time_to_peer_tau_ratio"] is None and "time_to_peer_tau_le_half" not in r["checks"]
    assert "dflash_seed_spread" not in r   # one dflash run: no spread
    ev["dflash_seed1"] = {"mtbench": {"tau": 1.44}, "humaneval": {"tau": 1.43}}
    ev["dflash_seed2"] = {"mtbench": {"tau": 1.47}, "humaneval": {"tau": 1.41}}
    bench.summarise(r)
    sp = r["dflash_seed_spread"]
    assert sp["runs"] == ["dflash", "dflash_seed1", "dflash_seed2"] and sp["mtbench"]["taus"] == [1.50, 1.44, 1.47]
    assert sp["mtbench"]["max_minus_min_over_mean"] == pytest.approx(0.06 / 1.47)
    assert r["tau_dflash_mtbench"] == 1.50   # the headline stays the main run's (seed --seed)
    assert "specforge_seed_spread" not in r and not any("seed_mean_ge_specforge_seed" in k for k in r["checks"])
    # one SpecForge run: dflash's seed mean against it (humaneval: the main run's 1.40 fails, the mean 1.4133 of
    # 1.40, 1.43, 1.41 passes 0.99 * 1.42)
    assert r["checks"]["mtbench_dflash_seed_mean_ge_specforge_minus_1pct"] is True
    assert r["checks"]["humaneval_dflash_seed_mean_ge_specforge_minus_1pct"] is True
    assert r["dflash_seed_mean_vs_specforge"]["mtbench"] == pytest.approx(
        {"relative": 0.02 / 1.45, "dflash_seed_spread": 0.06 / 1.47, "specforge": "one run"})
    ev["specforge_seed1"] = {"mtbench": {"tau": 1.55}, "humaneval": {"tau": 1.40}}
    bench.summarise(r)
    assert r["specforge_seed_spread"]["runs"] == ["specforge", "specforge_seed1"]
    assert r["specforge_seed_spread"]["mtbench"]["mean"] == pytest.approx(1.50)
    assert r["checks"]["mtbench_dflash_seed_mean_ge_specforge_seed_mean_minus_1pct"] is False   # 1.47 < 0.99 * 1.5
    assert r["checks"]["humaneval_dflash_seed_mean_ge_specforge_seed_mean_minus_1pct"] is True   # 1.4133 vs 1.41
    assert not any(k.endswith("seed_mean_ge_specforge_minus_1pct") for k in r["checks"])
    assert r["dflash_seed_mean_vs_specforge"]["mtbench"]["specforge"] == "seed mean"
    assert "specforge_seed1" in bench.format_table(r)


def test_time_ratio_from_the_longer_run_when_the_same_steps_run_falls_short(bench):
    """--dflash-time-epochs: the same-steps run never reaches SpecForge's final tau, so the ratio is taken at the
    longer run's first evaluation at or above it, its stamps shifted by stage f's extraction (it trains from that
    cache); a same-steps hit wins over the longer run; neither reaching it leaves the ratio unset."""
    ev = {"dflash": {"mtbench": {"tau": 1.40}}, "specforge": {"mtbench": {"tau": 1.45}},
          "dflash_epochs6": {"mtbench": {"tau": 1.60}}}
    r = {"eval": ev, "specforge": {"run": {"wall_s": 200.0}},
         "dflash": {"extract_wall_s": 10.0, "wall_s": 60.0, "heldout": [{"wall_s": 50.0, "step": 10, "tau": 1.40}]},
         "dflash_long": {"epochs": 6, "wall_s": 150.0, "heldout": [{"wall_s": 40.0, "step": 10, "tau": 1.30},
                                                                    {"wall_s": 70.0, "step": 20, "tau": 1.45},
                                                                    {"wall_s": 100.0, "step": 30, "tau": 1.55}]}}
    bench.summarise(r)
    assert r["time_to_peer_tau"]["dflash_first_at_or_above"] == {"wall_s": 80.0, "step": 20, "tau": 1.45}
    assert r["time_to_peer_tau_ratio"] == pytest.approx(0.4) and "6-epoch" in r["time_to_peer_tau"]["dflash_run"]
    assert "dflash_seed_spread" not in r   # the longer run is not another seed
    table = bench.format_table(r)
    assert "dflash_epochs6" in table and "160.0" in table   # its wall: stage f's extraction + its own
    r["dflash"]["heldout"].append({"wall_s": 58.0, "step": 20, "tau": 1.46})
    bench.summarise(r)
    assert r["time_to_peer_tau_ratio"] == pytest.approx(58.0 / 200.0) and "same-steps" in r["time_to_peer_tau"]["dflash_run"]
    r["dflash"]["heldout"].pop()
    r["dflash_long"]["heldout"] = r["dflash_long"]["heldout"][:1]
    bench.summarise(r)
    assert r["time_to_peer_tau_ratio"] is None and r["time_to_peer_tau"]["dflash_run"] is None


def test_time_ratio_on_the_card_of_the_dflash_run(bench):
    """SpecForge's segments trained on two cards: its wall time for the ratio is on the card of the dflash run
    that reached its tau (the other card's micro-steps at that card's measured rate); with no segment on that card
    the ratio stays unset, saying why."""
    h100, h200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"
    segs = [{"start_step": 0, "end_step": 4000, "startup_s": 60.0, "train_s": 400.0, "lost_s": 20.0, "card": h100},
            {"start_step": 4000, "end_step": 7000, "startup_s": 50.0, "train_s": 200.0, "lost_s": 0.0, "card": h200}]
    r = {"eval": {"dflash": {"mtbench": {"tau": 1.6}}, "specforge": {"mtbench": {"tau": 1.5}}},
         "specforge": {"run": {"wall_s": 660.0, "segments": segs}}, "stage_cards": {"f_dflash": h100},
         "dflash": {"heldout": [{"wall_s": 152.0, "step": 10, "tau": 1.55}]}}
    bench.summarise(r)
    t = r["time_to_peer_tau"]
    assert t["specforge_wall_s"] == 760.0 and t["card"] == h100   # 60 + 400 + 3,000 micro-steps at 10/s
    assert r["time_to_peer_tau_ratio"] == pytest.approx(0.2) and "1 of 2 segments" in t["specforge_wall_basis"]
    r["stage_cards"]["f_dflash"] = "NVIDIA B200"
    bench.summarise(r)
    assert r["time_to_peer_tau_ratio"] is None and "no SpecForge segment trained on NVIDIA B200" in \
        r["time_to_peer_tau"]["specforge_wall_basis"]
    r["stage_cards"]["f_dflash"] = h200   # all on one card: its measured sum
    for seg in segs:
        seg["card"] = h200
    bench.summarise(r)
    t = r["time_to_peer_tau"]
    assert t["specforge_wall_s"] == 660.0 and t["specforge_wall_basis"] == "measured"


def test_time_epochs_must_exceed_the_recipe_epochs(bench):
    assert bench.parse_args([]).dflash_time_epochs == 6 and bench.parse_args(["--tiny"]).dflash_time_epochs is None
    with pytest.raises(SystemExit):
        bench.parse_args(["--dflash-time-epochs", "2"])


def test_dflash_variants_parse_to_train_config_fields(bench):
    """--dflash-variants: the GPU default attributes the normalization and the anchor bound; values read as JSON
    when they parse; a name the seed or long runs use, an unknown field or a missing value is a usage error."""
    from dflash.train.config import TrainConfig

    assert bench.parse_args([]).dflash_variants == {"token": {"loss_normalization": "token"},
                                                   "sequence": {"loss_normalization": "sequence"},
                                                   "fullblocks": {"anchor_positions": "full_blocks"},
                                                   "steps8": {"step_samples": 8, "batch_tokens": 16384}}
    assert bench.parse_args(["--tiny"]).dflash_variants == {}
    assert bench.parse_args(["--dflash-variants", "none"]).dflash_variants == {}
    got = bench.parse_variants("a=lr:0.001,anchor_positions:full_blocks; b_2=grad_clip:0")
    assert got == {"a": {"lr": 0.001, "anchor_positions": "full_blocks"}, "b_2": {"grad_clip": 0}}
    TrainConfig(cache="c", model="m", output="o", **got["a"])   # the fields build a config
    for bad in ("seed1=lr:0.1", "epochs6=lr:0.1", "x=learning_rate:0.1", "x=lr", "x=", "X=lr:1", "a=lr:1;a=lr:2"):
        with pytest.raises(ValueError, match="--dflash-variants"):
            bench.parse_variants(bad)
    with pytest.raises(SystemExit):
        bench.parse_args(["--dflash-variants", "x=nope:1"])
    assert bench.variant_run("fullblocks") == "dflash_fullblocks"
    assert bench.seed_runs(["dflash", "dflash_seed1", "dflash_fullblocks", "dflash_epochs6"], "dflash") == [
        "dflash", "dflash_seed1"]


def test_variant_effects_relative_to_the_main_run_and_specforge(bench):
    r = {"eval": {"dflash": {"mtbench": {"tau": 1.10}, "humaneval": {"tau": 1.15}},
                  "specforge": {"mtbench": {"tau": 1.12}, "humaneval": {"tau": 1.15}},
                  "dflash_steps8": {"mtbench": {"tau": 1.121}}},
         "dflash_variants": {"steps8": {"overrides": {"step_samples": 8}}, "fullblocks": {}}}
    bench.summarise(r)
    eff = r["variant_effects"]
    assert set(eff) == {"steps8"} and set(eff["steps8"]) == {"mtbench"}   # fullblocks not scored yet
    assert eff["steps8"]["mtbench"]["vs_dflash"] == pytest.approx(0.021 / 1.10)
    assert eff["steps8"]["mtbench"]["vs_specforge"] == pytest.approx(0.001 / 1.12)


def test_zlab_loop_tau_next_to_the_eval_on_the_same_prompts(bench):
    """The loop ran the first 2 prompts: the eval's tau over sample ids 0 and 1 (in whatever order the cache holds
    them) is what it compares with; a set without them (a 1-token response, a result from before per-sequence taus
    were recorded) is left out."""
    ev = {"dflash": {"mtbench": {"tau": 1.3, "per_sequence_tau": {"2": 1.0, "0": 2.0, "1": 1.0}},
                     "humaneval": {"tau": 1.2, "per_sequence_tau": {"1": 1.1, "2": 1.4}}}}   # id 0: no step
    z = {"dflash": {"loads_cleanly": True,
                    "mtbench": {"tau": 1.4, "sequences": 2, "prefix_fraction": 0.5, "equal_fraction": 0.0},
                    "humaneval": {"tau": 1.1, "sequences": 2, "prefix_fraction": 1.0, "equal_fraction": 1.0}},
         "specforge": {"loads_cleanly": True, "mtbench": {"tau": 1.2, "sequences": 2}}}
    assert bench.zlab_vs_eval(ev, z) == {"dflash": {"mtbench": {
        "zlab_tau": 1.4, "eval_tau_same_prompts": 1.5, "prompts": 2, "prefix_fraction": 0.5, "equal_fraction": 0.0}}}


def test_tqdm_progress_reads_the_last_bar(bench):
    """The H200 run of 2026-12-02 cut at the call limit: its log's last bar updates (carriage-return separated)."""
    log = ("Starting training from epoch 0, step 0\n"
           "Training Epoch 0: 100%|██████████| 1944/1944 [04:28<00:00,  7.24it/s, loss=6.1, acc=0.08, iter_time=0.13s]\n"
           "Training Epoch 1:  54%|█████▍    | 1059/1944 [02:29<01:58,  7.50it/s, loss=5.9389, acc=0.0946, iter_time=0.14s]"
           "\rTraining Epoch 1:  55%|█████▍    | 1061/1944 [02:29<01:59,  7.36it/s, loss=5.0608, acc=0.1675, "
           "iter_time=0.14s]")
    assert bench.tqdm_progress(log) == {"epoch": 2, "micro_step_in_epoch": 1061, "micro_steps_per_epoch": 1944,
                                        "seconds_in_epoch": 149, "sequences_per_s": 7.36}
    slow = "Training Epoch 0:   0%|          | 3/1944 [1:02:05<9:00:00,  1.52s/it, loss=9]"
    assert bench.tqdm_progress(slow) == {"epoch": 1, "micro_step_in_epoch": 3, "micro_steps_per_epoch": 1944,
                                         "seconds_in_epoch": 3725, "sequences_per_s": 1 / 1.52}
    assert bench.tqdm_progress("Loading the target\n") is None


def test_cpu_failure_reason_names_the_error(bench):
    tail = ("[rank0]:   File \"x.py\", line 1\n[rank0]: RuntimeError: Distributed package doesn't have NCCL built in\n"
            "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n=====")
    assert bench.cpu_failure_reason(tail) == "RuntimeError: Distributed package doesn't have NCCL built in"


def test_zlab_cache_crop_keeps_the_legacy_meaning():
    """z-lab's loop calls DynamicCache.crop(absolute length); the cache the bench hands it keeps that meaning on
    transformers versions that refuse a positive crop (and is transformers' own class where it works)."""
    import zlab_loop
    from transformers import DynamicCache

    cls, _ = zlab_loop.absolute_crop_cache(DynamicCache)
    c = cls()
    c.update(torch.zeros(1, 1, 5, 2), torch.arange(10.0).view(1, 1, 5, 2), 0)
    c.crop(3)
    assert c.get_seq_length() == 3
    assert torch.equal(c.layers[0].values, torch.arange(6.0).view(1, 1, 3, 2))
    c.crop(7)   # longer than the cache: nothing to drop
    assert c.get_seq_length() == 3


def test_gpu_runs_score_on_the_committed_eval_responses(bench):
    """The GPU default copies the committed target-greedy responses (80 MT-Bench, 164 HumanEval records made by
    `dflash generate`, greedy, one target config hash) so runs of different sessions score on one eval set;
    --eval-responses none and the tiny CPU run generate their own."""
    import gzip
    import json

    assert bench.parse_args([]).eval_responses == str(bench.PEER_EVAL_RESPONSES)
    assert bench.parse_args(["--eval-responses", "none"]).eval_responses is None
    assert bench.parse_args(["--tiny"]).eval_responses is None
    hashes = set()
    for fname, count in (("mtbench_greedy.jsonl", 80), ("humaneval_greedy.jsonl", 164)):
        lines = gzip.decompress((bench.PEER_EVAL_RESPONSES / (fname + ".gz")).read_bytes()).decode().splitlines()
        recs = [json.loads(ln) for ln in lines]
        assert len(recs) == count and all(r["dflash_generate"]["greedy"] for r in recs)
        hashes |= {r["dflash_generate"]["target_config_hash"] for r in recs}
    assert len(hashes) == 1


@pytest.fixture(scope="module")
def specforge_objective(peers):
    """SpecForge's OnlineDFlashModel (specforge/core/dflash.py) and its DFlashDraftModel, imported from the snapshot
    under a package of their own (specforge/__init__ imports sglang, yunchang, datasets): the two files and the
    draft registry they import, nothing else of SpecForge."""
    root = peers["specforge"] / "specforge"
    saved = {k: sys.modules.get(k) for k in ("specforge", "specforge.modeling", "specforge.modeling.draft")}
    for name, path in (("specforge", root), ("specforge.modeling", root / "modeling"),
                       ("specforge.modeling.draft", root / "modeling" / "draft")):
        _package(name, path)
    try:
        draft = importlib.import_module("specforge.modeling.draft.dflash")
        core = _load_by_path("specforge_core_dflash_under_test", root / "core" / "dflash.py")
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    return draft.DFlashDraftModel, core.OnlineDFlashModel


def _peer_pair(specforge_objective, *, seed: int = 0):
    """One drafter, twice: dflash's DFlashDrafter and SpecForge's DFlashDraftModel holding the same weights (a
    2-layer drafter over a 5-tap 64-wide target, vocabulary 256, fp32), with the frozen embedding / LM head."""
    from transformers import Qwen3Config

    from dflash.drafter.model import DFlashDrafter

    DraftModel, Online = specforge_objective
    recipe = peer_recipe.PeerRecipe(num_layers=2, mask_token_id=3)
    tcfg = peer_recipe.train_config(recipe, cache="c", model="m", output="o", steps=10, batch_tokens=4096)
    dc = peer_recipe.drafter_config(recipe, target_config=dict(hidden_size=64, num_hidden_layers=8, vocab_size=256),
                                    train_cfg=tcfg)
    torch.manual_seed(seed)
    ours = DFlashDrafter(dc)
    hf = Qwen3Config(**dc.to_hf_config())
    hf._attn_implementation = "sdpa"   # SpecForge's --attention-backend sdpa: its boolean block mask
    theirs = DraftModel(hf)
    missing, unexpected = theirs.load_state_dict(ours.state_dict(), strict=False)
    assert not unexpected and all("rotary_emb" in k for k in missing)
    embed_VD = torch.randn(dc.vocab_size, dc.hidden_size) * 0.5
    head_VD = torch.randn(dc.vocab_size, dc.hidden_size) * 0.5
    embed, head = torch.nn.Embedding(dc.vocab_size, dc.hidden_size), torch.nn.Linear(dc.hidden_size, dc.vocab_size,
                                                                                       bias=False)
    embed.weight.data.copy_(embed_VD)
    head.weight.data.copy_(head_VD)
    online = Online(theirs, head, embed, mask_token_id=recipe.mask_token_id, block_size=recipe.block_size,
                    attention_backend="sdpa", num_anchors=recipe.num_anchors, loss_decay_gamma=recipe.gamma)
    return ours, online, embed_VD, head_VD, recipe, dc


def _specforge_loss(online, ids_S, mask_S, hidden_SKD, anchors_J):
    """SpecForge's loss of one sequence (its batch of 1) with the given anchors instead of its random draw."""
    online._sample_anchor_positions = lambda seq_len, loss_mask, device: (
        anchors_J[None].long(), torch.ones(1, len(anchors_J), dtype=torch.bool))
    loss, _, _ = online(ids_S[None], hidden_SKD.flatten(1)[None], mask_S[None].float())
    return loss


def _dflash_loss(ours, seqs, anchors, embed_VD, head_VD, recipe, normalization):
    """dflash's micro-batch loss of the sequences packed into one micro-batch, with the given anchors."""
    from dflash.train.loader import MicroBatch
    from dflash.train.objective import supervised_slots
    from dflash.train.step import HostBlocks, micro_batch_loss

    ids, masks, hidden = (torch.cat([s[i] for s in seqs]) for i in range(3))
    mb = MicroBatch(sample_ids=np.arange(len(seqs)), lengths=np.asarray([len(s[0]) for s in seqs]), input_ids_T=ids,
                    loss_mask_T=masks, hidden_TKD=hidden)
    supervised = sum(supervised_slots(s[1].numpy(), a.numpy(), block_size=recipe.block_size)
                     for s, a in zip(seqs, anchors))
    hb = HostBlocks(anchors_J=torch.cat(anchors), blocks_per_sample=[len(a) for a in anchors],
                    supervised_tokens=supervised, visible_keys=0)
    return micro_batch_loss(ours, mb, hb, embed_VD=embed_VD, lm_head_VD=head_VD, mask_token_id=recipe.mask_token_id,
                            gamma=recipe.gamma, loss_chunk_blocks=4, loss_impl="fused_eager",
                            loss_normalization=normalization).loss


def _sequence(dc, *, length: int, prompt: int, seed: int, anchors: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, dc.vocab_size, (length,), generator=g)
    mask = torch.arange(length) >= prompt
    hidden = torch.randn(length, dc.num_taps, dc.hidden_size, generator=g)
    # anchors both trainers could draw: response positions a <= S - B with a response token after them
    cand = torch.arange(prompt, length - 16 + 1)
    return ids, mask, hidden, cand[torch.randperm(len(cand), generator=g)[:anchors]].sort().values


def test_specforge_and_dflash_minimise_the_same_loss(specforge_objective):
    """Same weights, same sequence, same anchors: SpecForge's OnlineDFlashModel loss (sdpa backend, gamma 7) and
    dflash's training loss agree to fp32 rounding, and so do their gradients. Packed, dflash's per-sequence
    normalization is the mean of SpecForge's per-sequence losses (its one sequence per micro-batch, averaged over
    the accumulation steps): the objective bench_peer trains both with. What remains different between the two
    trainers is the anchor draw, the data order and the optimizer's precision, not the loss."""
    ours, online, embed_VD, head_VD, recipe, dc = _peer_pair(specforge_objective)
    a = _sequence(dc, length=90, prompt=30, seed=1, anchors=12)
    b = _sequence(dc, length=61, prompt=12, seed=2, anchors=4)
    sf_a = _specforge_loss(online, a[0], a[1], a[2], a[3])
    ours_a = _dflash_loss(ours, [a[:3]], [a[3]], embed_VD, head_VD, recipe, "token")
    assert float(ours_a) == pytest.approx(float(sf_a), rel=1e-5)
    sf_a.backward()
    ours_a.backward()
    theirs = dict(online.draft_model.named_parameters())
    for name, p in ours.named_parameters():
        assert torch.allclose(p.grad, theirs[name].grad, rtol=1e-4, atol=1e-7), name
    sf_b = _specforge_loss(online, b[0], b[1], b[2], b[3])
    packed = _dflash_loss(ours, [a[:3], b[:3]], [a[3], b[3]], embed_VD, head_VD, recipe, "sequence")
    assert float(packed) == pytest.approx((float(sf_a) + float(sf_b)) / 2, rel=1e-5)
    token = _dflash_loss(ours, [a[:3], b[:3]], [a[3], b[3]], embed_VD, head_VD, recipe, "token")
    assert abs(float(token) - float(packed)) > 1e-4   # the token mean weighs the sequences by their slots instead


def test_a_dflash_run_that_would_not_finish_waits_for_the_next_call(bench):
    """Session 2 of the 10x run: the set-up stages again took 235 s, then steps8 ran into the call's 570 s cap.
    Expected time: the longest finished run with its two scores, x DFLASH_RUN_MARGIN."""
    seconds = {"f_extract": 85.2, "f_dflash": 239.8, "h_eval_dflash_mtbench": 1.6, "h_eval_dflash_humaneval": 1.1,
               "f_dflash_seed1": 245.0, "h_eval_dflash_seed1_mtbench": 1.5, "h_eval_dflash_seed1_humaneval": 1.0}
    expected = bench.DFLASH_RUN_MARGIN * 247.5
    assert not bench.room_for_dflash_run(530, 234.7, seconds)
    assert bench.room_for_dflash_run(530, 10.0, seconds)          # the next call on the warm machine
    assert bench.room_for_dflash_run(530, 530 - expected, seconds)
    assert not bench.room_for_dflash_run(530, 530 - expected + 0.1, seconds)
    assert bench.room_for_dflash_run(None, 10_000.0, seconds)     # no deadline: no limit
    assert bench.room_for_dflash_run(530, 400.0, {"f_extract": 85.2})   # nothing measured yet
