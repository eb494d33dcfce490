"""The peer trainers' environment: unpack the MIT snapshots of SpecForge and z-lab/dflash (../shared/peers/) into
the git-ignored folder .peer/, install what SpecForge needs and this project lacks into .peer/site (pip --target,
never into the project's venv), and name the import stubs its HF path needs.

Tradeoff: the peers run from their unmodified sources in a separate process (SpecForge under torchrun) or as a
module loaded by file path (z-lab's model.py: its package is also called `dflash`), so nothing of theirs is copied
into this project and nothing of ours shadows theirs. The stubs stand in for modules whose code SpecForge's HF
backend imports but never runs; every one is listed in STUBS with its reason and goes into the result JSON.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.machinery
import importlib.util
import os
import pathlib
import subprocess
import sys
import tarfile

REPO = pathlib.Path(__file__).resolve().parents[2]
# ../shared/peers beside the checkout; a device machine's copy of the working tree may hold shared/ inside it
PEERS = next((p for p in (REPO.parent / "shared" / "peers", REPO / "shared" / "peers") if p.is_dir()),
             REPO.parent / "shared" / "peers")
UNPACK = REPO / ".peer"          # git-ignored
SITE = UNPACK / "site"            # pip --target folder for SpecForge's extra packages
SPECFORGE_TAR = "specforge-40d8feff.tar.gz"
ZLAB_TAR = "zlab-dflash-44947fb.tar.gz"

# What SpecForge@40d8feff imports on the DFlash HF path and this project does not install (module -> distribution).
# pandas/xxhash/multiprocess/dill come with `datasets` (load_dataset("json"), Dataset.map/filter), dateutil with
# pandas; yunchang is imported and called by specforge.distributed.init_distributed (set_seq_parallel_pg, sizes 1).
# datasets 5.2 also needs pyarrow >= 24, fsspec <= 2026.9.0 and huggingface-hub >= 1.31 (the project's env has them).
# pydantic: specforge/data/template.py's ChatTemplate (the GPU machine's image has none; CPU envs get it with
# transformers serve's extras).
NEEDED = {"yunchang": "yunchang", "datasets": "datasets", "dill": "dill", "multiprocess": "multiprocess",
          "xxhash": "xxhash", "pandas": "pandas", "dateutil": "python-dateutil", "pydantic": "pydantic",
          "pydantic_core": "pydantic-core", "annotated_types": "annotated-types",
          "typing_inspection": "typing-inspection"}
# Versions pinned for the GPU machine's .whl/ (python 3.12, manylinux2014_x86_64), the ones checked here on CPU.
WHEELS = {"yunchang": "0.6.4", "datasets": "5.2.0", "dill": "0.4.1", "multiprocess": "0.70.19", "xxhash": "4.1.0",
          "pandas": "3.1.1", "python-dateutil": "4.0.0", "pyarrow": "26.0.1", "pydantic": "2.14.4",
          "pydantic-core": "2.50.5", "annotated-types": "0.8.0", "typing-inspection": "0.4.5"}
# Installed distributions datasets 5.2 needs newer than the project does (pyarrow >= 14 there).
MIN_VERSIONS = {"pyarrow": (24,)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Stub:
    """A module put into sys.modules before SpecForge is imported."""

    module: str
    """dotted module name"""
    attrs: dict
    """attribute name -> value the importer needs at import time"""
    reason: str
    """why its code is never run on the DFlash HF path"""
    cpu_only: bool = False
    """needed only where the real package is absent by design (no triton on CPU)"""


class _NeverCalled:
    """Stands in for a class that SpecForge imports but the DFlash HF trainer never instantiates."""

    def __init__(self, *args, **kwargs):
        raise RuntimeError(f"{type(self).__name__}: stubbed for the peer benchmark, must not run")


STUBS = (
    Stub(module="sglang", attrs={}, reason="package root of the stub below"),
    Stub(module="sglang.srt", attrs={}, reason="package root of the stub below"),
    Stub(module="sglang.srt.server_args",
         attrs={"ATTENTION_BACKEND_CHOICES": ["fa3", "flashinfer", "triton", "torch_native"]},
         reason="specforge/args.py reads ATTENTION_BACKEND_CHOICES for the choices of --sglang-attention-backend; "
                "the HF target backend never starts SGLang"),
    Stub(module="specforge.core.loss", attrs={"LogSoftmaxLoss": type("LogSoftmaxLoss", (_NeverCalled,), {})},
         reason="imports triton at module level for the Eagle3 loss kernels; the DFlash trainer never calls it "
                "(a triton stub package would make torch._dynamo believe triton exists)", cpu_only=True),
)


def unpack(*, peers: pathlib.Path = PEERS, dest: pathlib.Path = UNPACK) -> dict[str, pathlib.Path]:
    """Extract both snapshots under `dest` once per tarball content (a .sha256 marker beside each folder)."""
    out = {}
    for key, name in (("specforge", SPECFORGE_TAR), ("zlab", ZLAB_TAR)):
        tar = peers / name
        if not tar.is_file():
            raise SystemExit(f"peer snapshot {tar} not found (expected ../shared/peers/{name})")
        digest = hashlib.sha256(tar.read_bytes()).hexdigest()
        folder = dest / name.removesuffix(".tar.gz")
        marker = dest / (folder.name + ".sha256")
        if not (marker.is_file() and marker.read_text().strip() == digest and folder.is_dir()):
            dest.mkdir(parents=True, exist_ok=True)
            with tarfile.open(tar) as tf:
                tf.extractall(dest, filter="data")
            if not folder.is_dir():
                raise SystemExit(f"{tar} did not unpack into {folder}")
            marker.write_text(digest + "\n")
        out[key] = folder
    return out


def missing_modules(*, site: pathlib.Path = SITE) -> list[str]:
    """Distributions of NEEDED whose module is importable neither from the running env nor from `site`, and those
    of MIN_VERSIONS older than needed."""
    from importlib.metadata import PackageNotFoundError, version

    importlib.invalidate_caches()  # SITE may have been created by this process after an earlier look
    path = [str(site), *sys.path]
    out = [dist for mod, dist in NEEDED.items() if importlib.machinery.PathFinder.find_spec(mod, path) is None]
    for dist, least in MIN_VERSIONS.items():
        if (site / dist).is_dir():
            continue  # installed into SITE by an earlier call
        try:
            have = tuple(int(x) for x in version(dist).split(".")[:len(least)])
        except (PackageNotFoundError, ValueError):
            have = ()
        if have < least:
            out.append(dist)
    return out


def install(dists: list[str], *, wheels: str | None, site: pathlib.Path = SITE) -> list[str]:
    """pip install --no-deps --target SITE: from the folder `wheels` (offline, the GPU machine) or the index."""
    if not dists:
        return []
    site.mkdir(parents=True, exist_ok=True)
    reqs = [f"{d}=={WHEELS[d]}" for d in dists]
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site)]
    cmd += ["--no-index", "--find-links", wheels] if wheels else []
    subprocess.run(cmd + reqs, check=True)
    return reqs


def stubs_report(*, cpu: bool) -> list[dict]:
    """The stubs in force, for the result JSON."""
    return [{"module": s.module, "reason": s.reason, "cpu_only": s.cpu_only} for s in STUBS
            if cpu or not s.cpu_only]


def specforge_env(specforge: pathlib.Path, *, cpu: bool) -> dict[str, str]:
    """Environment for SpecForge's process: its source tree and SITE first on PYTHONPATH, the stub switch."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(specforge), str(SITE), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PEER_STUBS_CPU"] = "1" if cpu else "0"
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def install_stubs(*, cpu: bool) -> list[str]:
    """Put STUBS into sys.modules (called in SpecForge's process before it imports anything of its own); a real
    installed sglang is used instead of its stubs. Returns the stubbed module names."""
    import types

    real_sglang = importlib.util.find_spec("sglang") is not None
    done = []
    for s in STUBS:
        if (s.cpu_only and not cpu) or (real_sglang and s.module.startswith("sglang")):
            continue
        m = types.ModuleType(s.module)
        m.__dict__.update(s.attrs)
        if s.module in ("sglang", "sglang.srt"):
            m.__path__ = []  # a package, so its submodules import
        sys.modules[s.module] = m
        done.append(s.module)
    return done


def load_zlab_model(zlab: pathlib.Path):
    """z-lab's dflash/model.py as module `zlab_dflash_model` (by file path: its package name is ours too)."""
    name = "zlab_dflash_model"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, zlab / "dflash" / "model.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
