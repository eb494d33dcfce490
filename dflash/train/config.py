"""TrainConfig: every knob of a `dflash train` run, loaded from YAML and overridden by CLI flags.

Resolution order: dataclass defaults < YAML file < CLI overrides (only flags the user actually gave).
The resolved config is written as JSON into every checkpoint and into RUN_DIR/config.json so a run can be
reproduced and resumed; a resume refuses a config that differs in a field that changes the math.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from dataclasses import dataclass
from typing import Any, Mapping

from dflash.compiled import COMPILE_SETTINGS
from dflash.errors import ConfigError
from dflash.train.noise import NoiseConfig

LOSS_NORMALIZATIONS = ("token", "sequence", "sample")
"""TrainConfig.loss_normalization's values (objective.per_sample_mean_weights makes the last two)."""
OBJECTIVES = ("dflash", "variable_prefix")
"""TrainConfig.objective's values (train.prefix: the blocks' visible prefixes of each)."""
ANCHOR_POSITIONS = ("response", "full_blocks")
"""TrainConfig.anchor_positions' values (objective.sample_anchors' full_block)."""
ARCHS = ("dflash", "dflash2")
"""TrainConfig.arch's values: the names of dflash.drafter.registry.ARCHS (not imported here: it imports torch)."""


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """One training run. Defaults are the DFlash paper's (reference/dflash-method.md sections 0 and 3)."""

    cache: str
    """Path of the hidden-state cache (written by `dflash extract`); with several caches, the first."""
    model: str
    """Target model folder; only its embedding and LM head are read (frozen), plus its tokenizer for the mask id."""
    output: str
    """Run folder: checkpoints/, metrics.jsonl, config.json, drafter/ (the export of the finished run)."""

    extra_caches: tuple[str, ...] = ()
    """More caches (paths or URLs) mixed into the run with `cache` (train.mixture): same target, taps and storage.
    In YAML give `caches: [{path: A, weight: 3}, {path: B, weight: 1}]` instead of cache / extra_caches /
    cache_weights."""
    cache_weights: tuple[float, ...] | None = None
    """One weight per cache (cache, then extra_caches): each step's samples come from the caches in proportion
    (an epoch is as many samples as the caches hold together; a cache weighted above its size share repeats,
    one below it is subsampled). None = each sample of every cache once per epoch (their union)."""
    init_from: str | None = None
    """Start from trained weights: a dflash run folder or checkpoint, or a drafter folder (config.json with
    dflash_config + model.safetensors, z-lab's format). The drafter's shape and taps come from it; the optimizer,
    schedule and data start fresh. None = a seeded random init."""

    # --- drafter shape (the hidden size comes from the cache, num_target_layers from the target) ---
    taps: tuple[int, ...] | None = None
    """Target layer ids to feed the drafter, a subset of the cache's taps (with --online any of the target's
    layers: the live target computes them); None = all taps of the cache."""
    num_layers: int = 5
    """Drafter decoder layers (paper: 5; 8 for Qwen3-Coder-30B-A3B)."""
    num_attention_heads: int | None = None
    """Drafter query heads; None = the DrafterConfig default (32), shrunk to fit small hidden sizes."""
    num_key_value_heads: int | None = None
    """Drafter KV heads; None = the DrafterConfig default (8), shrunk to fit small hidden sizes."""
    head_dim: int | None = None
    """Drafter head dim; None = the DrafterConfig default (128), or hidden/heads for small hidden sizes."""
    intermediate_size: int | None = None
    """Drafter MLP width; None = 3 x hidden size (Qwen3-8B drafter: 12288 = 3 x 4096)."""
    block_size: int = 16
    """Tokens per block: the anchor plus block_size-1 masked slots (paper: 16; 10 for LLaMA-3.1-8B)."""
    layer_types: tuple[str, ...] | None = None
    """Attention of each drafter layer, full_attention or sliding_attention, one per layer (SpecForge's
    qwen3.6-27b-dflash: 4 x sliding_attention + full_attention); None = all full_attention (the paper)."""
    sliding_window: int | None = None
    """Window of the sliding_attention layers in tokens, the query's own slot included: a block query at
    position p sees keys at positions > p - sliding_window (qwen3.6-27b-dflash: 2048). Required with sliding
    layers."""
    causal: bool | None = None
    """In-block causality of every layer (exported as dflash_config.causal, which vLLM reads): true = slot k sees
    only slots <= k of its block. None = by layer type, as SGLang serves them: sliding layers causal, full layers
    bidirectional."""
    rope_theta: float = 1e7
    """Drafter RoPE base (1e6 for Qwen3 drafters, 1e7 for Qwen3.5)."""
    mask_token_id: int | None = None
    """Id whose frozen target embedding fills the masked slots. None = the tokenizer's mask token if it has
    one, else its pad token if that is not also eos; otherwise set it (e.g. an unused id). Qwen3: 151669."""
    arch: str = "dflash"
    """Drafter architecture: dflash = the paper's drafter (DFlashDraftModel); dflash2 = DFlash 2
    (DFlash2DraftModel: a two-tap dynamic convolution around every draft sublayer and a pairwise path selector
    over each slot's top-k candidates, trained by loss = block CE + selector_weight x selector CE; docs/dflash2.md)."""
    selector_weight: float = 1.0
    """arch dflash2: weight of the selector's CE (over the top-k candidates, given the true predecessor) in the
    loss; 0 trains the backbone only. 1.0 is NeMo Automodel's default (DFlash2TrainerModule.selector_loss_weight),
    whose selector term is a mean over the slots with the true token among the candidates; here it shares the
    block CE's normaliser, so the same weight counts the selector term times the candidate recall."""
    selector_rank: int = 256
    """arch dflash2: rank of the selector's codebooks ([vocab, rank] each) and hidden projection."""
    selector_top_k: int = 16
    """arch dflash2: candidates per drafted slot the selector chooses among."""
    conv_group_size: int = 16
    """arch dflash2: channels sharing one dynamic convolution coefficient (must divide the hidden size)."""
    gamma: float | None = None
    """Loss decay exp(-(k-1)/gamma) per block position; None = 7 for B=16, 5 for B=10, 4 for B=8, else 7B/16."""
    objective: str = "dflash"
    """Training objective: dflash = the paper's (each block reveals its anchor, slots 1..B-1 supervised);
    variable_prefix = D2SD's VP-Drafter (arXiv 2606.04446): each block reveals a prefix of l real tokens, l drawn
    from a truncated geometric prior over [min(2, B-1), B-1] (prefix_weight_base), and only the masked slots k >= l
    are supervised, weighted exp(-(k-l)/gamma). Held-out tau decodes with the standard prefix 1 either way."""
    prefix_weight_base: float = 0.9
    """variable_prefix's prior: Pr(l) proportional to prefix_weight_base^l (below 1 favours short prefixes; 1 is
    uniform; NeMo Automodel's and SpecForge's default 0.9). Unused by the dflash objective."""
    loss_normalization: str = "token"
    """How a step's loss averages: token = the decay-weighted mean over every block token of the step (long
    samples, with more anchors, weigh more); sequence = each sample's decay-weighted mean, then the mean over
    the step's samples (z-lab's and SpecForge's loss with one sequence per micro-batch); sample = each sample's
    decay-weighted mean, summed over the step and divided by the run's mean samples per step (a constant), so
    every sample weighs the same whichever step it lands in: SpecForge's objective over an epoch, whose steps
    hold a fixed number of sequences. (A token-budget step that holds a long sample has room for fewer others,
    so under `sequence`, where a sample weighs 1 / its step's sample count, a long sample weighs more.) Where the
    gradient clip is active (in every log window of the SmolLM2 reference run) a step's scale is clipped away,
    so sample and sequence give the same updates; step_samples is what evens the samples' weights then."""

    # --- optimisation ---
    lr: float = 6e-4
    """Peak AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay (SpecForge's paper-aligned config uses 0)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas (torch defaults; the paper does not state them)."""
    warmup_ratio: float = 0.04
    """Fraction of all optimizer steps spent in linear warmup."""
    min_lr_ratio: float = 0.0
    """Cosine floor as a fraction of lr."""
    grad_clip: float = 1.0
    """Global gradient-norm clip; 0 disables."""
    epochs: int = 6
    """Passes over the cache; ignored when `steps` is set."""
    steps: int | None = None
    """Total optimizer steps (may span epochs); None = `epochs` full epochs."""
    batch_tokens: int = 16384
    """Token budget of one micro-batch per rank (context tokens of the packed samples)."""
    grad_accum: int = 1
    """Micro-batches per rank per optimizer step; a step covers world_size x grad_accum micro-batches."""
    step_samples: int | None = None
    """Samples per optimizer step (all ranks): each step takes the next step_samples of the epoch's shuffled
    samples, packed into its world_size x grad_accum micro-batches of batch_tokens (a step that needs more is a
    ConfigError: raise grad_accum or batch_tokens), as trainers that batch by sequence count do (SpecForge).
    None = token-budget steps: as many samples as world_size x grad_accum full micro-batches hold. With the
    gradient clip active (in every log window of the SmolLM2 reference run), a sample weighs 1 / its step's
    sample count, so fixed-count steps weigh all samples alike and token-budget steps weigh long ones up."""
    num_anchors: int = 512
    """Anchors (blocks) sampled per sequence, resampled every epoch (paper: 512)."""
    anchor_positions: str = "response"
    """Where anchors may fall: response = any response token whose next token is supervised (the paper's "from
    the response"; blocks near the sequence's end are cut short, their slots past it unsupervised); full_blocks =
    only anchors whose whole block lies inside the sequence (a <= S - block_size, SpecForge's bound), so the
    last block_size - 2 response tokens of a sample are never anchors and its last token is predicted only from
    the slot block_size - 1 away."""
    seed: int = 0
    """Seeds the model init, the per-epoch shuffle and the per-(epoch, sample) anchor draws."""
    shuffle_seed: int | None = None
    """Seed of the per-epoch shuffle only; None = `seed`. A sweep sets it so runs of different seeds share one
    data stream (a run alone with the same shuffle_seed sees the same micro-batches)."""
    shuffle_block: int = 0
    """Samples kept together in the epoch's order: 0 shuffles every sample; N >= 2 visits runs of N samples that
    neighbour each other in the cache's storage (the runs in a seeded random order, their boundaries moving every
    epoch), so a micro-batch reads a few long stretches of a shard instead of one request per sample and tap: for
    a cache read by URL from an object store, which pays per request (docs/storage.md). A coarser shuffle: storage
    neighbours were extracted in one length-sorted batch. Not with cache_weights."""
    dtype: str = "auto"
    """Compute dtype for autocast: auto = bfloat16 on CUDA, float32 on CPU; or bfloat16 / float32."""
    loss_chunk_blocks: int = 128
    """Blocks per LM-head cross-entropy chunk (bounds the logits memory)."""
    loss_impl: str = "fused"
    """LM-head cross-entropy: fused = logits once per supervised row, input-gradient formed in the forward
    (train.fused_ce; its elementwise work, when compile_elementwise compiles the drafter's, one hand-written
    Triton kernel on CUDA with triton installed, else compiled: fused_ce.train_epilogue);
    fused_eager = the same, never compiled; checkpoint = the chunk-checkpointed path over all rows
    (objective.chunked_ce_loss, three head matmuls per row). Same math up to fp32 summation order."""
    compile_elementwise: str = "auto"
    """Run the drafter's norms, RoPE and SiLU-gating, and the fused LM-head CE's elementwise work (train.fused_ce,
    with loss_impl=fused; Triton's kernel where it runs), as fused kernels: auto = on CUDA only (CPU compilation
    needs a C++ toolchain and gains little), on, off. Same math up to float rounding."""
    wgrad_fusion: str = "auto"
    """Add each linear weight's gradient into its fp32 .grad inside the weight-gradient matmul (train.wgrad)
    instead of autograd's bf16 gradient, cast and add: auto = on CUDA, on, off. Same math up to float rounding;
    at the 27B drafter shape on an H100 a step is 0.65% faster (results/train_h200_wgrad.json)."""

    online: bool = False
    """Compute the drafter's taps with the live target for every micro-batch instead of reading them from the
    cache (the cache still gives the token stream: same samples, order and anchors as a cached run). The
    baseline the cache replaces; the target forward is paid every step and counted in tokens/s."""
    online_compile: str = "off"
    """With --online: run the live target's decoder layers torch.compile'd (one graph for all layers of a class,
    dynamic shapes): auto = on CUDA only, on, off. The online step is host-bound on the eager target's kernel
    launches; off until the compiled one is timed on the GPU (bench_smollm2_step online_fp8_compiled). Same
    math up to float rounding."""
    online_storage: str | None = None
    """With --online: round the live taps through this cache storage's encoding and decoding (bf16, fp8, int4 or a
    4-bit format name), the features a cache of that storage would give the drafter, so its quality cost is
    measured without writing the cache (one too large for the disk). Unset: the taps as the target computes them."""

    # --- feature-noise augmentation (train/noise.py), off by default ---
    noise_start: float = 0.0
    """Peak Gaussian noise std on the cached features, relative to each token's and tap's RMS, reached after
    noise_warmup_ratio of the steps; 0 = off."""
    noise_end: float = 0.0
    """Feature-noise std at the last step (the decay's floor), relative like noise_start."""
    noise_warmup_ratio: float = 0.04
    """Fraction of the steps over which the feature-noise std ramps from 0 to noise_start."""
    noise_decay: str = "cosine"
    """Decay of the feature-noise std after its warm-up: cosine or linear."""

    # --- held-out evaluation ---
    eval_cache: str | None = None
    """Target-greedy eval cache (`dflash generate` + `dflash extract`): exact held-out tau every `eval_every`
    steps and at the end, on rank 0, into metrics.jsonl (heldout_* fields) and TensorBoard. None = off."""
    eval_every: int = 200
    """Optimizer steps between held-out evaluations (such a step is also a log step). By FLOPs one evaluation
    of the all-anchor schedule (eval.batched) is ~2-3 training steps at the GPU defaults (SmolLM2 reference:
    244 eval sequences = ~1M block rows forward-only, against ~150K rows forward+backward per step), so 200
    should keep it near 1-2% of training time; bench_eval_overhead.py measures it (the aim: <= 5%)."""
    eval_limit: int | None = None
    """Evaluate only the first N sequences of the eval cache; None = all."""

    # --- loader ---
    num_readers: int = 2
    """Reader threads filling pinned host buffers."""
    prefetch: int = 4
    """Micro-batches read ahead (host buffers in flight)."""
    verify_checksums: bool = True
    """Check the crc32c of every cache chunk read."""

    # --- bookkeeping ---
    log_every: int = 10
    """Optimizer steps between metric logs (the only steps that synchronise the host with the GPU)."""
    save_every: int = 500
    """Optimizer steps between checkpoints (a final one is always written)."""
    keep_checkpoints: int = 2
    """Newest checkpoints kept in RUN_DIR/checkpoints."""
    peak_flops: float | None = None
    """Peak FLOP/s per device for MFU; None = 790e12 on CUDA (H200 bf16 dense), no MFU on CPU."""
    stop_after_steps: int | None = None
    """Stop (with a checkpoint) after this many steps of this invocation; for tests of resume. None = run to the end."""
    report_to: tuple[str, ...] | None = None
    """Where metrics go besides metrics.jsonl: tensorboard and/or wandb, comma-separated, or none. Unset =
    TensorBoard when the tensorboard package is installed. W&B: project $WANDB_PROJECT (else dflash), run files
    under RUN_DIR/wandb; WANDB_MODE=offline needs no network (`wandb sync` uploads later)."""

    def __post_init__(self) -> None:
        _positive(self, "num_layers", "block_size", "epochs", "batch_tokens", "grad_accum", "num_anchors",
                  "num_readers", "prefetch", "log_every", "save_every", "keep_checkpoints", "loss_chunk_blocks",
                  "eval_every")
        if self.step_samples is not None and (not isinstance(self.step_samples, int) or self.step_samples < 1):
            raise ConfigError(f"step_samples={self.step_samples!r}: must be a positive integer (or unset for "
                              "token-budget steps)")
        if not isinstance(self.shuffle_block, int) or self.shuffle_block < 0:
            raise ConfigError(f"shuffle_block={self.shuffle_block!r}: must be 0 (shuffle every sample) or the "
                              "samples a run keeps together")
        if self.shuffle_block and self.cache_weights is not None:
            raise ConfigError("shuffle_block with cache_weights: a mixture draws every cache's samples in its own "
                              "order; set one of them")
        if self.eval_limit is not None and self.eval_limit < 1:
            raise ConfigError(f"eval_limit={self.eval_limit}: must be >= 1 (or unset for the whole eval cache)")
        if self.block_size < 2:
            raise ConfigError(f"block_size={self.block_size}: a block needs the anchor plus at least one slot (>= 2)")
        if self.steps is not None and self.steps < 1:
            raise ConfigError(f"steps={self.steps}: must be >= 1 (or unset to train `epochs` epochs)")
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise ConfigError(f"warmup_ratio={self.warmup_ratio}: must be in [0, 1)")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"min_lr_ratio={self.min_lr_ratio}: must be in [0, 1]")
        if self.lr <= 0 or self.grad_clip < 0 or self.weight_decay < 0:
            raise ConfigError(f"lr={self.lr}, grad_clip={self.grad_clip}, weight_decay={self.weight_decay}: "
                              "lr must be > 0, grad_clip and weight_decay >= 0")
        for name in ("compile_elementwise", "wgrad_fusion"):
            if getattr(self, name) not in COMPILE_SETTINGS:
                raise ConfigError(f"{name}={getattr(self, name)!r}: choose auto, on or off")
        if self.loss_normalization not in LOSS_NORMALIZATIONS:
            raise ConfigError(f"loss_normalization={self.loss_normalization!r}: "
                              f"choose {', '.join(LOSS_NORMALIZATIONS[:-1])} or {LOSS_NORMALIZATIONS[-1]}")
        if self.arch not in ARCHS:
            raise ConfigError(f"arch={self.arch!r}: choose {' or '.join(ARCHS)}")
        if self.selector_weight < 0:
            raise ConfigError(f"selector_weight={self.selector_weight}: must be >= 0")
        _positive(self, "selector_rank", "selector_top_k", "conv_group_size")
        if self.anchor_positions not in ANCHOR_POSITIONS:
            raise ConfigError(f"anchor_positions={self.anchor_positions!r}: choose {' or '.join(ANCHOR_POSITIONS)}")
        if self.loss_impl not in ("fused", "fused_eager", "checkpoint"):
            raise ConfigError(f"loss_impl={self.loss_impl!r}: choose fused, fused_eager or checkpoint")
        if self.dtype not in ("auto", "bfloat16", "float32"):
            raise ConfigError(f"dtype={self.dtype!r}: choose auto, bfloat16 or float32")
        if self.taps is not None and len(self.taps) == 0:
            raise ConfigError("taps=(): give at least one tap layer id, or leave it unset for all cached taps")
        from dflash.drafter.config import check_layer_types

        check_layer_types(self.layer_types, num_layers=self.num_layers, sliding_window=self.sliding_window)
        if self.causal is not None and not isinstance(self.causal, bool):
            raise ConfigError(f"causal={self.causal!r}: true, false, or unset (by layer type)")
        if self.objective not in OBJECTIVES:
            raise ConfigError(f"objective={self.objective!r}: choose {' or '.join(OBJECTIVES)}")
        if not (isinstance(self.prefix_weight_base, (int, float)) and self.prefix_weight_base > 0):
            raise ConfigError(f"prefix_weight_base={self.prefix_weight_base!r}: must be > 0 (0.9 favours short "
                              "prefixes, 1 is uniform)")
        if self.gamma is not None and self.gamma <= 0:
            raise ConfigError(f"gamma={self.gamma}: must be > 0")
        if self.online_compile not in COMPILE_SETTINGS:
            raise ConfigError(f"online_compile={self.online_compile!r}: choose {', '.join(COMPILE_SETTINGS)}")
        if self.online_storage is not None:
            if not self.online:
                raise ConfigError(f"online_storage={self.online_storage!r} rounds the live target's taps: it needs "
                                  "--online")
            from dflash.cache.format import resolve_storage

            resolve_storage(self.online_storage)  # ConfigError naming the choices
        from dflash.train.reporters import parse_report_to

        object.__setattr__(self, "report_to", parse_report_to(self.report_to))  # ConfigError naming a bad name
        if len(set(self.cache_paths)) != len(self.cache_paths):
            raise ConfigError(f"caches {list(self.cache_paths)}: a cache is given twice; give each once and weigh "
                              "it with cache_weights")
        if self.cache_weights is not None:
            from dflash.train.mixture import check_weights

            check_weights(self.cache_weights, 1 + len(self.extra_caches))
        self.noise  # noqa: B018 (NoiseConfig validates the noise fields)

    @property
    def noise(self) -> NoiseConfig:
        """The feature-noise schedule of this run."""
        return NoiseConfig(noise_start=self.noise_start, noise_end=self.noise_end,
                           warmup_ratio=self.noise_warmup_ratio, decay=self.noise_decay)

    @property
    def cache_paths(self) -> tuple[str, ...]:
        """Every training cache: cache, then extra_caches."""
        return (self.cache, *self.extra_caches)

    @property
    def data_seed(self) -> int:
        """The seed of the per-epoch shuffle (shuffle_seed, else seed)."""
        return self.seed if self.shuffle_seed is None else self.shuffle_seed

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# Fields that may differ between a run and its resume (paths, bookkeeping); anything else changes the math.
# loss_impl, compile_elementwise, wgrad_fusion and online_compile change only float rounding (and checkpoints
# written before they existed lack the fields). Not online: live features are unrounded, an fp8 or bf16 cache's
# are not.
# extra_caches too: which samples the caches hold is checked against the checkpoint's cache record instead;
# init_from only seeds a fresh run's weights (a resume loads its checkpoint's).
RESUME_MUTABLE = frozenset({"cache", "extra_caches", "init_from", "model", "output", "log_every", "save_every",
                            "keep_checkpoints",
                            "num_readers", "prefetch", "verify_checksums", "peak_flops", "stop_after_steps",
                            "loss_impl", "compile_elementwise", "wgrad_fusion", "online_compile", "eval_cache",
                            "eval_every",
                            "eval_limit", "report_to"})


def _positive(cfg: TrainConfig, *names: str) -> None:
    for name in names:
        value = getattr(cfg, name)
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name}={value!r}: must be a positive integer")


_FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}


def _coerce(name: str, value: Any) -> Any:
    # YAML and JSON give lists; the frozen config keeps tuples so it hashes and compares by value.
    if name == "layer_types" and value is not None:
        return (value,) if isinstance(value, str) else tuple(value)
    if name in ("taps", "betas", "cache_weights", "extra_caches") and value is not None:
        if isinstance(value, (int, float)):
            value = [value]
        return tuple(value)
    return value


def config_from_dict(data: Mapping[str, Any]) -> TrainConfig:
    """Build a TrainConfig from a flat mapping, naming unknown keys and type problems."""
    data = expand_caches(data)
    unknown = sorted(set(data) - set(_FIELDS))
    if unknown:
        raise ConfigError(f"unknown train config keys {unknown}; valid keys: {sorted(_FIELDS)}")
    try:
        return TrainConfig(**{k: _coerce(k, v) for k, v in data.items()})
    except TypeError as e:  # a required field is missing
        raise ConfigError(f"train config: {e}") from e


def expand_caches(data: Mapping[str, Any]) -> dict[str, Any]:
    """The YAML form `caches: [{path, weight}, ...]` (or a list of paths) as cache / extra_caches / cache_weights;
    ConfigError when it is given beside those keys or an entry lacks its path."""
    out = dict(data)
    if "caches" not in out:
        return out
    entries = out.pop("caches")
    if not isinstance(entries, list) or not entries:
        raise ConfigError("caches: give a list of {path, weight} entries (or of paths)")
    clash = sorted(k for k in ("extra_caches", "cache_weights") if k in out)
    if clash:
        raise ConfigError(f"caches is given with {clash}: use caches alone")
    paths, weights = [], []
    for e in entries:
        e = {"path": e} if isinstance(e, str) else e
        if not isinstance(e, dict) or "path" not in e or set(e) - {"path", "weight"}:
            raise ConfigError(f"caches entry {e!r}: give path and optionally weight")
        paths.append(str(e["path"]))
        weights.append(e.get("weight"))
    if "cache" in out and out["cache"] not in (None, paths[0]):
        raise ConfigError(f"cache {out['cache']!r} and caches are both given: use one of them")
    if any(w is not None for w in weights) and any(w is None for w in weights):
        raise ConfigError("caches: give every entry a weight, or none")
    out.update(cache=paths[0], extra_caches=tuple(paths[1:]),
               cache_weights=None if weights[0] is None else tuple(float(w) for w in weights))
    return out


def load_train_config(yaml_path: str | pathlib.Path | None, overrides: Mapping[str, Any]) -> TrainConfig:
    """Defaults < YAML < overrides. `overrides` holds only the values the user gave (None values are dropped)."""
    data: dict[str, Any] = {}
    if yaml_path is not None:
        import yaml

        path = pathlib.Path(yaml_path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        loaded = yaml.safe_load(path.read_text()) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {str(path)!r} must hold a mapping of TrainConfig fields")
        data.update(expand_caches(loaded))
    data.update({k: v for k, v in overrides.items() if v is not None})
    return config_from_dict(data)


def check_resume_compatible(saved: Mapping[str, Any], current: TrainConfig) -> None:
    """Raise ConfigError naming the first field that differs in a way that would break an exact resume."""
    now = json.loads(json.dumps(current.to_json()))
    for name in sorted(_FIELDS):
        if name in RESUME_MUTABLE:
            continue
        # a field the checkpoint lacks (written before the field existed) had its default value
        old = saved[name] if name in saved else _FIELDS[name].default
        if json.loads(json.dumps(old)) != now[name]:
            raise ConfigError(
                f"--resume with a different {name!r}: the checkpoint has {old!r}, this run has "
                f"{now[name]!r}. Resume with the original settings, or start a new run in an empty folder.")


def field_docs() -> dict[str, str]:
    """TrainConfig field name -> its docstring (whitespace collapsed): the one source of the help texts of
    `dflash train`'s options (cli/train_cmd.py generates them)."""
    import ast
    import inspect

    body = ast.parse(inspect.getsource(TrainConfig)).body[0].body  # type: ignore[attr-defined]
    out: dict[str, str] = {}
    for prev, node in zip(body, body[1:]):
        if (isinstance(prev, ast.AnnAssign) and isinstance(prev.target, ast.Name) and isinstance(node, ast.Expr)
                and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)):
            out[prev.target.id] = " ".join(node.value.value.split())
    return out


__all__ = ["ARCHS", "LOSS_NORMALIZATIONS", "OBJECTIVES",
           "TrainConfig", "load_train_config", "config_from_dict", "check_resume_compatible",
           "RESUME_MUTABLE", "field_docs"]
