"""export_drafter / load_drafter: atomic HF-format folder, identical outputs after a round trip."""

import json

import pytest
import torch
from safetensors import safe_open

from dflash.drafter.config import DrafterConfig
from dflash.drafter.export import export_drafter, load_drafter
from dflash.drafter.model import DFlashDrafter
from dflash.errors import ConfigError, ModelNotFoundError


def tiny():
    cfg = DrafterConfig(hidden_size=32, intermediate_size=48, target_layer_ids=(0, 2), num_target_layers=4,
                        mask_token_id=3, vocab_size=40, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=8, block_size=4)
    torch.manual_seed(0)
    return DFlashDrafter(cfg), cfg


def run(model, dtype):
    g = torch.Generator().manual_seed(1)
    feats = torch.randn(6, 2, 32, generator=g).to(dtype)
    block = torch.randn(4, 32, generator=g).to(dtype)
    q_pos = torch.arange(6, 10)
    with torch.no_grad():
        return model(block, model.context(feats), q_pos=q_pos, kv_pos=torch.cat([torch.arange(6), q_pos]))


def test_round_trip_bf16_gives_identical_outputs(tmp_path):
    model, cfg = tiny()
    out = export_drafter(model, cfg, tmp_path / "drafter")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "dflash.py", "model.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["drafter"]          # no temp dir left behind
    loaded, cfg2 = load_drafter(out)
    assert cfg2 == cfg
    assert next(loaded.parameters()).dtype == torch.bfloat16
    torch.testing.assert_close(run(loaded, torch.bfloat16), run(model.to(torch.bfloat16), torch.bfloat16),
                               rtol=0, atol=0)


def test_round_trip_fp32_and_dtype_override(tmp_path):
    model, cfg = tiny()
    export_drafter(model, cfg, tmp_path / "d", dtype=torch.float32)
    loaded, _ = load_drafter(tmp_path / "d", dtype=torch.float64)
    assert next(loaded.parameters()).dtype == torch.float64
    loaded32, _ = load_drafter(tmp_path / "d")
    torch.testing.assert_close(run(loaded32, torch.float32), run(model, torch.float32), rtol=0, atol=0)
    assert json.loads((tmp_path / "d" / "config.json").read_text())["dtype"] == "float32"


def test_files_follow_the_published_layout(tmp_path):
    model, cfg = tiny()
    out = export_drafter(model, cfg, tmp_path / "d")
    hf = json.loads((out / "config.json").read_text())
    assert hf == json.loads(json.dumps(cfg.to_hf_config()))
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert f.get_tensor("fc.weight").dtype == torch.bfloat16
    assert names == set(model.state_dict())
    assert "layers.1.self_attn.k_norm.weight" in names and "hidden_norm.weight" in names


def test_export_refuses_non_empty_dir_unless_overwrite(tmp_path):
    model, cfg = tiny()
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "notes.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="not empty"):
        export_drafter(model, cfg, tmp_path / "d")
    assert (tmp_path / "d" / "notes.txt").exists()
    export_drafter(model, cfg, tmp_path / "d", overwrite=True)
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["config.json", "dflash.py", "model.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["d"]


def test_load_rejects_non_drafter_folders(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        load_drafter(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"],
                                                      "model_type": "qwen3"}))
    with pytest.raises(ModelNotFoundError, match="not a DFlash drafter"):
        load_drafter(tmp_path)
    model, cfg = tiny()
    out = export_drafter(model, cfg, tmp_path / "d")
    (out / "model.safetensors").unlink()
    with pytest.raises(ModelNotFoundError, match="model.safetensors"):
        load_drafter(out)


def test_load_rejects_weights_that_do_not_match_config(tmp_path):
    model, cfg = tiny()
    out = export_drafter(model, cfg, tmp_path / "d")
    hf = json.loads((out / "config.json").read_text())
    hf["num_hidden_layers"] = 3
    hf["layer_types"] = ["full_attention"] * 3
    (out / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ModelNotFoundError, match="missing"):
        load_drafter(out)
    hf["num_hidden_layers"], hf["layer_types"] = 2, ["full_attention"] * 2
    hf["intermediate_size"] = 64
    (out / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ModelNotFoundError, match="does not match"):
        load_drafter(out)


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_exported_files_respect_the_umask(tmp_path, umask):
    """Issue 19: model.safetensors was written 0600 (safetensors) while config.json was 0644."""
    import os
    import stat

    model, cfg = tiny()
    old = os.umask(umask)
    try:
        out = export_drafter(model, cfg, tmp_path / "d")
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert modes == {"config.json": 0o666 & ~umask, "dflash.py": 0o666 & ~umask, "model.safetensors": 0o666 & ~umask}
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~umask


def test_cli_export_refuses_a_non_empty_folder_then_overwrites(tmp_path):
    """The refusal used to suggest overwrite=True, which `dflash export` had no flag for."""
    from click.testing import CliRunner

    from cli.main import cli
    from dflash.train.checkpoint import DataPosition, save_checkpoint

    model, cfg = tiny()
    ckpt = save_checkpoint(tmp_path / "run", model_state=model.state_dict(), optimizer_state={}, scheduler_state={},
                           position=DataPosition(epoch=0, step_in_epoch=7, global_step=7), world_size=1,
                           train_config={}, drafter_config=cfg.to_json())
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "notes.txt").write_text("keep me")
    res = CliRunner().invoke(cli, ["export", str(ckpt), "--output", str(tmp_path / "d")])
    assert res.exit_code == 1 and "overwrite=True" not in res.output
    assert "is not empty (notes.txt): choose another --output folder, or pass --overwrite" in res.output
    assert (tmp_path / "d" / "notes.txt").exists()
    res = CliRunner().invoke(cli, ["export", str(ckpt), "--output", str(tmp_path / "d"), "--overwrite",
                                   "--dtype", "float32"])
    assert res.exit_code == 0, res.output
    assert "exported step 7" in res.output
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["README.md", "config.json", "dflash.py",
                                                                  "model.safetensors"]
    loaded, _ = load_drafter(tmp_path / "d")
    torch.testing.assert_close(run(loaded, torch.float32), run(model, torch.float32))
