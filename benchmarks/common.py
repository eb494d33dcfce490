"""Helpers shared by the benchmark scripts: the 27B target shape, a measured matmul peak, cold page cache,
and a target folder that holds only the embedding and LM head (what training reads of a target).

Scripts import it as `from common import ...` (they run as `python benchmarks/bench_X.py`, so this folder is
on sys.path) and need only torch, numpy, transformers and safetensors besides dflash.
"""

from __future__ import annotations

import os
import pathlib
import platform
import statistics
import time

import numpy as np
import torch

# The H200's dense bf16 tensor-core spec (NVIDIA H200 SXM datasheet: 1,979 TFLOP/s is with 2:4 sparsity).
# Benchmarks report MFU over the peak they measure (matmul_peak, ~710-790 TFLOP/s) and over this spec, each
# with its denominator named (mfu_fields), so a figure is never read against the wrong one.
H200_SPEC_BF16 = 989e12

# Qwen3.5-27B text shape (DESIGN.md, "Performance method"): 26.9B parameters.
QWEN35_27B = dict(hidden_size=5120, intermediate_size=17408, num_hidden_layers=64, num_attention_heads=24,
                  num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=48,
                  linear_key_head_dim=128, linear_value_head_dim=128, vocab_size=248320)


def say_as(name: str):
    """A progress printer for script `name`: "[name HH:MM:SS] msg", flushed (a device call's log keeps order)."""
    def say(msg: str) -> None:
        print(f"[{name} {time.strftime('%H:%M:%S')}] {msg}", flush=True)
    return say


def shape_fingerprint(storage: str, *, hidden: int, taps: tuple[int, ...], target: str, max_length: int | None = None):
    """The Fingerprint of a cache of random features at the 27B target's depth (64 layers): what a benchmark's
    writer needs when no real target exists (hashes "-")."""
    from dflash.cache import Fingerprint

    extra = {} if max_length is None else {"max_length": max_length}
    return Fingerprint(target=target, target_config_hash="-", num_target_layers=64, hidden_size=hidden,
                       target_dtype="bfloat16", tokenizer_hash="-", chat_template_hash="-", tap_layer_ids=tuple(taps),
                       storage=storage, **extra)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def error_line(e: BaseException) -> str:
    """An exception as one line for a result JSON: its type and the first line of its message (300 chars at
    most), for a variant or a compare that fails without ending the benchmark."""
    msg = str(e)
    return f"{type(e).__name__}: {msg.splitlines()[0][:300] if msg else ''}"


def timed(fn, device: torch.device, repeats: int) -> tuple[float, object]:
    """Median seconds of `repeats` synced calls of fn after one untimed call (compiles, autotuning), and the last
    call's result."""
    out = fn()
    times = []
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        out = fn()
        sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def matmul_peak(device: torch.device) -> float:
    """Dense matmul FLOP/s measured here: bf16 8192^3 on CUDA (~700-720 TFLOP/s on the H200), fp32 1024^3 on
    CPU; median of 10 timed groups after 2 warm-up groups."""
    n = 8192 if device.type == "cuda" else 1024
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    times = []
    for _ in range(12):
        sync(device)
        t = time.perf_counter()
        for _ in range(5):
            a @ b
        sync(device)
        times.append((time.perf_counter() - t) / 5)
    return 2 * n**3 / statistics.median(times[2:])


def matmul_sustained(device: torch.device, *, seconds: float | None = None) -> float:
    """The same products as matmul_peak back to back for `seconds` (3 on CUDA, 0.5 on CPU): the rate a
    minutes-long workload can expect once clocks and power settle. matmul_peak's 60 ms burst read 699-781
    TFLOP/s across H200 sessions while the workloads' achieved FLOP/s stayed within ~4%; benchmarks record
    this beside it (measured after their workload, on the warm GPU) so an MFU can be read against both."""
    n = 8192 if device.type == "cuda" else 1024
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    seconds = seconds if seconds is not None else (3.0 if device.type == "cuda" else 0.5)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    count = 0
    sync(device)
    t = time.perf_counter()
    while time.perf_counter() - t < seconds:
        for _ in range(20):  # ~30 ms of queued work on the H200 between host checks
            a @ b
        count += 20
        sync(device)
    return 2 * n**3 * count / (time.perf_counter() - t)


SUSTAINED_DENOMINATOR = ("matmul_sustained: the same bf16 8192^3 products back to back for 3 s, after the "
                         "workload")


def mfu_vs_sustained(mfu: float, *, peak: float, sustained: float) -> float:
    """An MFU over the burst `peak` (mfu_fields' `mfu`) read over the sustained rate instead."""
    return mfu * peak / sustained


def mfu_fields(mfu: float | None, *, peak: float) -> dict:
    """MFU over the measured matmul `peak` and over the H200 spec, with both denominators named. `mfu` is
    achieved FLOP/s over `peak` (what the trainer's metrics and the benchmarks compute)."""
    return {"mfu": mfu, "mfu_vs_spec_989": None if mfu is None else mfu * peak / H200_SPEC_BF16,
            "mfu_denominator": f"measured matmul peak (matmul_peak: bf16 on CUDA, fp32 on CPU) "
                               f"{peak / 1e12:.3g} TFLOP/s",
            "mfu_vs_spec_989_denominator": f"H200 dense bf16 spec {H200_SPEC_BF16 / 1e12:.0f} TFLOP/s"}


def drop_page_cache(*paths: str | os.PathLike) -> str:
    """Make the next reads of `paths` (files or folders) come from the disk: drop_caches as root, else
    posix_fadvise DONTNEED per file (clean pages only). Returns which method worked."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        pass
    for p in paths:
        p = pathlib.Path(p)
        for f in ([p] if p.is_file() else [q for q in p.rglob("*") if q.is_file()]):
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return "posix_fadvise DONTNEED"


def make_head_only_target(path: pathlib.Path, *, hidden: int, vocab: int, target_layers: int,
                          device: torch.device | str = "cpu") -> None:
    """config.json (Qwen3.5 text, untied; the 27B shape when hidden is 5120, else a tiny one), the tiny
    tokenizer, and a model.safetensors holding only model.embed_tokens.weight and lm_head.weight (random
    bf16): enough for `dflash train`, which reads nothing else of a target."""
    from safetensors.torch import save_file
    from transformers import Qwen3_5TextConfig

    from dflash.target.testing import tiny_qwen35_text_kwargs, tiny_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    if hidden == QWEN35_27B["hidden_size"]:
        kw = dict(QWEN35_27B)
    else:
        kw = tiny_qwen35_text_kwargs(num_layers=target_layers, vocab_size=vocab)
        kw.update(hidden_size=hidden, intermediate_size=2 * hidden)
    cfg = Qwen3_5TextConfig(**{**kw, "tie_word_embeddings": False})
    cfg.architectures = ["Qwen3_5ForCausalLM"]
    cfg.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    g = torch.Generator(device=device).manual_seed(1)
    tensors = {name: (0.02 * torch.randn(vocab, hidden, device=device, generator=g)).to(torch.bfloat16).cpu()
               for name in ("model.embed_tokens.weight", "lm_head.weight")}
    save_file(tensors, str(path / "model.safetensors"))


def package_version(dist: str) -> str | None:
    """Installed version of distribution `dist`, or None."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def machine_info(device: torch.device) -> dict:
    """What ran it; BENCH_NOTE (set by benchmarks/run_h200.sh) says what else ran on the machine meanwhile."""
    info = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else platform.processor(),
            "cpus": os.cpu_count(), "platform": platform.platform()}
    if device.type == "cuda":
        info["gpus_on_machine"] = torch.cuda.device_count()
        info["cuda_visible_devices"] = os.environ.get("CUDA_VISIBLE_DEVICES")
    if os.environ.get("BENCH_NOTE"):
        info["note"] = os.environ["BENCH_NOTE"]
    return info


def make_random_fp8_cache(path: pathlib.Path, target: pathlib.Path, sh: dict, *, num_samples: int, seed: int = 0,
                          device: torch.device | str = "cpu", lengths: np.ndarray | None = None,
                          loss_tokens: np.ndarray | None = None) -> dict:
    """A cache of `num_samples` random sequences of sh["seq_len"] tokens written through CacheWriter as fp8
    (quantised on `device`), with a fingerprint the trainer accepts for the head-only target at `target`.
    sh holds hidden, taps, target_layers, vocab, seq_len. With `lengths` (int [num_samples], e.g. real
    ShareGPT lengths) and `loss_tokens`, sample i has lengths[i] tokens of which the last loss_tokens[i] carry
    the loss; else every sample is seq_len long with a random 10-40% prompt without loss.
    Returns samples, tokens, bytes on disk and write seconds."""
    from transformers import AutoTokenizer

    from dflash.cache import CacheWriter, Fingerprint
    from dflash.cache.format import encode_hidden
    from dflash.target.identity import target_config_hash, tokenizer_hash

    tok = AutoTokenizer.from_pretrained(target)  # reloaded, as the trainer does: same class, same hash
    S, K, D = sh["seq_len"], len(sh["taps"]), sh["hidden"]
    lengths_N = np.full(num_samples, S, np.int64) if lengths is None else np.asarray(lengths, np.int64)
    assert len(lengths_N) == num_samples and (loss_tokens is None) == (lengths is None), "lengths with loss_tokens"
    fp = Fingerprint(target=str(target), target_config_hash=target_config_hash(target),
                     num_target_layers=sh["target_layers"], hidden_size=sh["hidden"], target_dtype="bfloat16",
                     tokenizer_hash=tokenizer_hash(tok), chat_template_hash="", tap_layer_ids=sh["taps"],
                     storage="fp8", max_length=max(S, int(lengths_N.max(initial=0))))
    device = torch.device(device)
    rng = np.random.default_rng(seed)
    g = torch.Generator(device=device).manual_seed(seed)
    outlier_channels = torch.randperm(D, generator=torch.Generator().manual_seed(seed))[:8].to(device)
    # appends of ~16K tokens: whole samples, so a group ends where the running token count passes a multiple
    ends = np.cumsum(lengths_N)
    group_N = (ends - 1) // (1 << 14) if lengths is not None else np.arange(num_samples) // max(1, (1 << 14) // S)
    t0 = time.perf_counter()
    with CacheWriter(path, fp) as w:
        for grp in np.unique(group_N):
            members = np.flatnonzero(group_N == grp)
            start, n, lens = int(members[0]), len(members), lengths_N[members]
            T = int(lens.sum())
            offsets = np.concatenate([[0], np.cumsum(lens)[:-1]])
            ids = rng.integers(0, sh["vocab"], size=T).astype(np.int32)
            mask = np.ones(T, np.uint8)
            for i in range(n):  # loss on the response only: the prompt comes first
                prompt = (int(rng.uniform(0.1, 0.4) * S) if loss_tokens is None
                          else int(lens[i]) - min(int(loss_tokens[start + i]), int(lens[i])))
                mask[offsets[i]: offsets[i] + prompt] = 0
            hidden = torch.randn(T, K, D, device=device, generator=g)
            hidden[:, :, outlier_channels] *= 20.0  # massive-activation channels, as real hidden states have
            spikes = torch.rand(T, K, D, device=device, generator=g) < 1e-4
            hidden = torch.where(spikes, hidden * 50.0, hidden)
            bits, scales = encode_hidden(hidden, "fp8")
            w.append(sample_ids=np.arange(start, start + n, dtype=np.int64), lengths=lens,
                     input_ids=ids, loss_mask=mask, hidden=bits.cpu(), scales=scales.cpu())
    os.sync()
    nbytes = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return {"samples": num_samples, "tokens": int(lengths_N.sum()), "bytes": nbytes,
            "write_s": time.perf_counter() - t0}
