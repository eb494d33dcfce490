"""Checkpoints are atomic (a crash mid-write leaves the old set intact), pruned, and export to a drafter."""

import os
import pathlib

import pytest
import torch

from dflash.errors import ModelNotFoundError
from dflash.train import checkpoint as ckpt


def _save(run, step, keep=2, payload=None):
    return ckpt.save_checkpoint(
        run, model_state={"w": torch.full((3,), float(step))} if payload is None else payload,
        optimizer_state={}, scheduler_state={}, position=ckpt.DataPosition(epoch=0, step_in_epoch=step,
                                                                           global_step=step),
        world_size=1, train_config={"seed": 0}, drafter_config={}, keep=keep)


def test_roundtrip_and_pruning(tmp_path):
    for step in (1, 2, 3):
        _save(tmp_path, step)
    names = [p.name for p in ckpt.list_checkpoints(tmp_path)]
    assert names == ["step-00000002.pt", "step-00000003.pt"]
    state = ckpt.load_checkpoint(tmp_path)  # a run folder -> its newest checkpoint
    assert ckpt.position_of(state).global_step == 3
    assert torch.equal(state["model"]["w"], torch.full((3,), 3.0))
    assert set(state["rng"]) >= {"python", "numpy", "torch"}


class _Boom(RuntimeError):
    pass


def test_crash_mid_write_keeps_previous_checkpoint(tmp_path, monkeypatch):
    _save(tmp_path, 1)
    real_save = torch.save

    def dying_save(obj, f, *a, **k):
        f.write(b"partial bytes of a torn checkpoint")
        raise _Boom("killed mid-write")

    monkeypatch.setattr(torch, "save", dying_save)
    with pytest.raises(_Boom):
        _save(tmp_path, 2)
    monkeypatch.setattr(torch, "save", real_save)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step-00000001.pt"]
    assert sorted(os.listdir(ckpt.checkpoint_dir(tmp_path))) == ["step-00000001.pt"]  # tmp removed
    assert ckpt.position_of(ckpt.load_checkpoint(tmp_path)).global_step == 1


def test_leftover_tmp_file_is_ignored(tmp_path):
    """A SIGKILL between write and os.replace leaves a tmp file: never picked up by resume."""
    _save(tmp_path, 4)
    (ckpt.checkpoint_dir(tmp_path) / ".step-00000006.pt.tmp-123").write_bytes(b"torn")
    assert ckpt.latest_checkpoint(tmp_path).name == "step-00000004.pt"


def test_load_errors(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no checkpoint"):
        ckpt.load_checkpoint(tmp_path)
    bad = tmp_path / "x.pt"
    torch.save({"a": 1}, bad)
    with pytest.raises(ModelNotFoundError, match="not a dflash training checkpoint"):
        ckpt.load_checkpoint(bad)
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        ckpt.load_checkpoint(tmp_path / "missing.pt")


def test_export_checkpoint_roundtrip(tmp_path):
    from dflash.drafter.config import DrafterConfig
    from dflash.drafter.export import load_drafter
    from dflash.drafter.model import DFlashDrafter
    from dflash.train.export import export_checkpoint

    dc = DrafterConfig(hidden_size=32, intermediate_size=64, target_layer_ids=(0, 2), num_target_layers=4,
                       mask_token_id=5, vocab_size=50, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=16)
    torch.manual_seed(0)
    model = DFlashDrafter(dc)
    ckpt.save_checkpoint(tmp_path / "run", model_state=model.state_dict(), optimizer_state={}, scheduler_state={},
                         position=ckpt.DataPosition(epoch=0, step_in_epoch=1, global_step=1), world_size=1,
                         train_config={}, drafter_config=dc.to_json())
    res = export_checkpoint(tmp_path / "run", tmp_path / "out", dtype="float32")
    assert res.step == 1 and res.checkpoint == ckpt.checkpoint_path(tmp_path / "run", 1)
    out = res.path
    loaded, cfg2 = load_drafter(out)
    assert cfg2 == dc
    for k, v in model.state_dict().items():
        assert torch.equal(v, loaded.state_dict()[k])
    assert pathlib.Path(out, "config.json").exists()


def test_plan_version_keeps_a_resumed_run_on_its_plan(tmp_path):
    _save(tmp_path, 1)
    state = ckpt.load_checkpoint(tmp_path)
    assert state["plan_version"] == ckpt.PLAN_VERSION == 2 and ckpt.plan_version_of(state) == 2
    assert ckpt.plan_version_of(None) == ckpt.PLAN_VERSION  # a fresh run
    del state["plan_version"]  # written before plan versions: the packing order
    assert ckpt.plan_version_of(state) == 1
