"""`--report-to tensorboard,wandb`: a real CPU training run with a held-out eval logs every scalar of
metrics.jsonl (loss, per-position acceptance, held-out tau per source, tokens/s, stall, MFU) to TensorBoard's
event files and to an offline W&B run (WANDB_MODE=offline, no network), with the run config; both are read
back from their files."""

import json
import pathlib
import struct
import sys

import pytest
from click.testing import CliRunner

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from test_export_card import _greedy_cache  # noqa: E402
from train_helpers import tiny_cache, tiny_target  # noqa: E402

from cli.main import cli  # noqa: E402
from dflash.errors import ConfigError  # noqa: E402
from dflash.train.config import config_from_dict, load_train_config  # noqa: E402
from dflash.train.metrics import read_metrics  # noqa: E402
from dflash.train.reporters import flat_scalars, parse_report_to  # noqa: E402


def test_parse_report_to(tmp_path):
    assert parse_report_to("tensorboard,wandb") == ("tensorboard", "wandb")
    assert parse_report_to(["wandb", "wandb"]) == ("wandb",)
    assert parse_report_to("none") == () and parse_report_to(None) is None
    with pytest.raises(ConfigError, match="unknown \\['mlflow'\\]"):
        parse_report_to("tensorboard,mlflow")
    base = dict(cache="c", model="m", output="o")
    assert config_from_dict({**base, "report_to": ["wandb"]}).report_to == ("wandb",)
    (tmp_path / "c.yaml").write_text("report_to: tensorboard, wandb\n")
    assert load_train_config(tmp_path / "c.yaml", base).report_to == ("tensorboard", "wandb")
    assert load_train_config(tmp_path / "c.yaml", {**base, "report_to": "none"}).report_to == ()
    # a sweep's base: every run reports
    from dflash.sweep.spec import load_sweep_spec

    (tmp_path / "s.yaml").write_text("base: {steps: 2, report_to: wandb}\ngrid: {lr: [0.001, 0.002]}\n")
    spec = load_sweep_spec(tmp_path / "s.yaml", cache="c", model="m", output=str(tmp_path / "sw"))
    assert [r.config.report_to for r in spec.runs] == [("wandb",), ("wandb",)]


def test_flat_scalars():
    rec = {"step": 3, "loss": 2.5, "acc": [0.5, 0.25], "mfu": None, "heldout_tau/mt.jsonl": 1.2, "online": True,
           "tokens_per_s": float("nan")}
    assert flat_scalars(rec) == {"train/loss": 2.5, "train/acc/1": 0.5, "train/acc/2": 0.25,
                                 "train/heldout_tau/mt.jsonl": 1.2}


def wandb_records(run_file: pathlib.Path):
    """The protobuf records of a .wandb file (a LevelDB-style log: 7-byte file header, 32 KiB blocks of records
    with a 7-byte header: crc32, length, type FULL=1 / FIRST=2 / MIDDLE=3 / LAST=4)."""
    from wandb.proto import wandb_internal_pb2 as pb

    buf, block, pos = run_file.read_bytes(), 32768, 7
    assert buf[:4] == b":W&B"
    parts, out = [], []
    while pos + 7 <= len(buf):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, n, kind = struct.unpack("<IHB", buf[pos:pos + 7])
        if n == 0 and kind == 0:   # zero padding to the block's end
            pos += left
            continue
        parts.append(buf[pos + 7:pos + 7 + n])
        pos += 7 + n
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(b"".join(parts))
            out.append(rec)
            parts = []
    return out


def test_train_reports_to_tensorboard_and_offline_wandb(tmp_path, monkeypatch):
    import wandb
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("DFLASH_NO_PROGRESS", "1")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_PROJECT", "dflash-test")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home"))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    target = tiny_target(tmp_path / "target")
    cache = tiny_cache(tmp_path / "cache", target, num_samples=12)
    evc = _greedy_cache(tmp_path, target, monkeypatch)
    (tmp_path / "c.yaml").write_text("peak_flops: 1.0e+12\n")   # MFU is logged on CPU only with a given peak
    run = tmp_path / "run"
    res = CliRunner().invoke(cli, ["train", "--cache", str(cache), "--model", str(target), "--output", str(run),
                                   "--device", "cpu", "--layers", "1", "--block-size", "4", "--num-anchors", "8",
                                   "--batch-tokens", "200", "--steps", "4", "--log-every", "1", "--eval-cache",
                                   str(evc), "--eval-every", "2", "--config", str(tmp_path / "c.yaml"),
                                   "--report-to", "tensorboard,wandb"], prog_name="dflash")
    try:
        assert res.exit_code == 0, res.output
    finally:
        wandb.teardown()
    records = read_metrics(run)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    expected = {(r["step"], k): v for r in records for k, v in flat_scalars(r).items()}
    for key in ("train/loss", "train/acc/1", "train/acc/3", "train/accept_len", "train/tokens_per_s",
                "train/stall_frac", "train/mfu", "train/heldout_tau", "train/heldout_tau/mt.jsonl",
                "train/heldout_tau/he.jsonl", "train/heldout_acc/1"):
        assert any(k == key for _, k in expected), key

    # TensorBoard: every scalar of every record, at its step (stored as float32)
    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0}).Reload()
    got = {(e.step, tag): e.value for tag in acc.Tags()["scalars"] for e in acc.Scalars(tag)}
    assert got.keys() == expected.keys()
    for k, v in expected.items():
        assert got[k] == pytest.approx(v, rel=1e-6, abs=1e-12), k
    text = acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert '"lr": 0.0006' in text and '"block_size": 4' in text

    # W&B: one offline run under RUN_DIR/wandb, the history and the config in its .wandb file
    (run_file,) = (run / "wandb").glob("offline-run-*/run-*.wandb")
    recs = wandb_records(run_file)
    (info,) = [r.run for r in recs if r.WhichOneof("record_type") == "run"]
    assert info.project == "dflash-test" and info.display_name == "run"
    config = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in info.config.update}
    assert config["train"]["report_to"] == ["tensorboard", "wandb"] and config["drafter"]["block_size"] == 4
    history = {}
    for r in recs:
        if r.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            history.update({(items["_step"], k): v for k, v in items.items() if k.startswith("train/")})
    assert history == expected
