"""`dflash demo`: the whole pipeline end to end on the embedded default target and data, in a few minutes on CPU.

Steps (each one a call into the library, timed and announced with a header):
  1. SmolLM2-135M-Instruct GGUF -> HF folder (dflash.target.assets.smollm2_hf_dir, cached across runs)
  2. the first N ShareGPT conversations -> DIR/conversations.jsonl -> training cache DIR/train_cache (dflash.extract)
  3. a small drafter trained on it -> DIR/train_run/drafter (dflash.train)
  4. the target's greedy responses to the first M MT-Bench turn-1 prompts -> DIR/mtbench_greedy.jsonl
     (dflash.eval.generate)
  5. eval cache DIR/eval_cache from that file (marked target_greedy by extraction)
  6. exact greedy tau of the trained drafter and of an untrained one of the same shape (DIR/untrained_drafter)
  7. a table, and DIR/demo_result.json

Resume: DIR/demo_config.json records the settings; a rerun with the same settings reuses every finished step
(extraction resumes from committed shards, training from its newest checkpoint, finished files are kept),
and a rerun with other settings is refused (use fresh=True / --fresh to start over).
Tradeoff: the CPU preset is sized for a 2-core machine (minutes, not hours), so its drafter is far from a
useful one; what it shows is that training moves tau clearly above the untrained drafter's ~1.0.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from dflash.durable import refuse_nonempty, replace_text
from dflash.errors import ConfigError

# SmolLM2's tokenizer has no mask token and pads with eos: 16 = <empty_output>, a special token the chat model
# never emits in conversations (configs/train_smollm2.yaml).
SMOLLM2_MASK_TOKEN_ID = 16
CONFIG_FILE = "demo_config.json"
RESULT_FILE = "demo_result.json"


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    """One `dflash demo` run. Use cpu_defaults() / gpu_defaults() / default_config() rather than all fields."""

    output: str = "demo_out"
    """Folder for every artefact (conversations, caches, run folder, drafters, generations, result JSON)."""
    device: str = "cpu"
    """"cpu" or "cuda": where the target, the trainer and the eval run."""
    conversations: int = 48
    """ShareGPT conversations (the first N records that parse) in the training cache."""
    max_length: int = 512
    """Training conversations are truncated to this many tokens."""
    target_dtype: str = "float32"
    """Target compute dtype for extraction and generation (float32 on CPU: faster and exact; bfloat16 on GPU)."""
    steps: int = 300
    """Drafter optimizer steps."""
    num_layers: int = 1
    """Drafter decoder layers (paper: 5)."""
    block_size: int = 4
    """Drafter block size B (paper: 16): the anchor plus B-1 drafted tokens. 4 on CPU: at the acceptance a
    few CPU minutes reach (~13% at slot 1) slots past 3 add nothing to tau, and B=4 halves the LM-head work."""
    num_anchors: int = 32
    """Anchors (blocks) sampled per training sequence per epoch (paper: 512)."""
    intermediate_size: int = 1536
    """Drafter MLP width."""
    lr: float = 3e-3
    """Peak AdamW learning rate."""
    batch_tokens: int = 1024
    """Context-token budget of one training micro-batch."""
    eval_prompts: int = 8
    """MT-Bench questions (turn 1, first M in file order) used for tau."""
    max_new_tokens: int = 64
    """Most tokens the target generates per eval prompt."""
    seed: int = 0
    """Seeds the drafter init (trained and untrained alike), the shuffle and the anchors."""

    def __post_init__(self) -> None:
        for name in ("conversations", "max_length", "steps", "num_layers", "num_anchors", "intermediate_size",
                     "batch_tokens", "eval_prompts", "max_new_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}={value!r}: must be a positive integer")
        if self.block_size < 2:
            raise ConfigError(f"block_size={self.block_size}: must be >= 2 (the anchor plus one drafted slot)")
        if self.device not in ("cpu", "cuda"):
            raise ConfigError(f"device={self.device!r}: use cpu or cuda")
        if self.target_dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"target_dtype={self.target_dtype!r}: use float32 or bfloat16")
        if self.batch_tokens < self.max_length:
            raise ConfigError(f"batch_tokens={self.batch_tokens} < max_length={self.max_length}: raise batch_tokens")

    def settings(self) -> dict[str, Any]:
        """Every field except `output`: what decides whether an existing output folder can be reused."""
        d = dataclasses.asdict(self)
        d.pop("output")
        return d


def cpu_defaults(**overrides: Any) -> DemoConfig:
    """Sized for a 2-core CPU: a few minutes in all (measured in README.md)."""
    return DemoConfig(**overrides)


def gpu_defaults(**overrides: Any) -> DemoConfig:
    """One GPU: more data, a paper-like drafter shape (smaller, for a 135M target), bf16 throughout."""
    base = dict(device="cuda", conversations=2000, max_length=2048, target_dtype="bfloat16", steps=2000,
                num_layers=2, block_size=16, num_anchors=256, intermediate_size=1536, lr=1e-3, batch_tokens=16384,
                eval_prompts=80, max_new_tokens=256)
    return DemoConfig(**{**base, **overrides})


def default_config(**overrides: Any) -> DemoConfig:
    """gpu_defaults when CUDA is available, else cpu_defaults; `overrides` (None values ignored) win."""
    import torch

    given = {k: v for k, v in overrides.items() if v is not None}
    return gpu_defaults(**given) if torch.cuda.is_available() else cpu_defaults(**given)


@dataclass(frozen=True, kw_only=True)
class DemoResult:
    """What the demo measured (also written to DIR/demo_result.json)."""

    output: str
    rows: list[dict]
    """One row per drafter: name, tau, accepted_per_step, sequences, steps, response_tokens, drafter_dir."""
    step_seconds: dict[str, float]
    """Wall seconds of each step, by step name."""
    seconds: float
    config: dict
    table: str

    def to_json(self) -> dict:
        return {"output": self.output, "rows": self.rows, "step_seconds": self.step_seconds, "seconds": self.seconds,
                "config": self.config}


@dataclass
class _Steps:
    """Prints a header per step and records its wall time."""

    echo: Callable[[str], None]
    total: int
    seconds: dict[str, float] = field(default_factory=dict)
    _n: int = 0

    def run(self, name: str, title: str, fn: Callable[[], Any]) -> Any:
        self._n += 1
        self.echo(f"\n=== [{self._n}/{self.total}] {title} ===")
        t0 = time.perf_counter()
        out = fn()
        self.seconds[name] = round(time.perf_counter() - t0, 2)
        self.echo(f"--- {name}: {self.seconds[name]:.1f} s")
        return out


def prepare_output(cfg: DemoConfig, *, fresh: bool) -> pathlib.Path:
    """Create the output folder, or check that an existing one was made with the same settings."""
    out = pathlib.Path(cfg.output)
    if fresh and out.exists():
        shutil.rmtree(out)
    saved_path = out / CONFIG_FILE
    if saved_path.is_file():
        saved = json.loads(saved_path.read_text())
        for name, value in cfg.settings().items():
            if saved.get(name) != value:
                raise ConfigError(f"{out} holds a demo run with {name}={saved.get(name)!r}, this run has {value!r}: "
                                  "rerun with the same settings to reuse its finished steps, pass --fresh to "
                                  "wipe it, or choose another --output")
    else:
        refuse_nonempty(out, what="--output", remedy=f"it holds no {CONFIG_FILE}, so it is not a demo folder; "
                                                     "pass --fresh to wipe it, or choose another --output")
    out.mkdir(parents=True, exist_ok=True)
    replace_text(saved_path, json.dumps(cfg.settings(), indent=2) + "\n")
    return out


def write_conversations(path: pathlib.Path, *, count: int) -> int:
    """The first `count` usable ShareGPT conversations as {"messages": [...]} lines (atomic; kept if present)."""
    from dflash.data.assets import sharegpt_conversations

    if path.is_file():
        return sum(1 for _ in path.open())
    lines = [json.dumps(c, ensure_ascii=False) for c in sharegpt_conversations(count)]
    replace_text(path, "\n".join(lines) + "\n")
    return len(lines)


def _extract(cfg: DemoConfig, *, model: str, data: pathlib.Path, output: pathlib.Path, max_length: int, echo):
    from dflash.extract.driver import ExtractConfig
    from dflash.extract.launch import launch

    ecfg = ExtractConfig(model=model, data=(str(data),), output=str(output), storage="bf16", max_length=max_length,
                         batch_tokens=max(cfg.batch_tokens, max_length), dtype=cfg.target_dtype, device=cfg.device)
    return launch(ecfg, num_procs=1, echo=echo)  # resumes a partial cache: committed samples are skipped


def _train(cfg: DemoConfig, *, model: str, cache: pathlib.Path, run_dir: pathlib.Path) -> pathlib.Path:
    from dflash.train.config import TrainConfig
    from dflash.train.trainer import train

    drafter = run_dir / "drafter"
    if (drafter / "config.json").is_file():  # a finished run exported its drafter atomically
        return drafter
    tcfg = TrainConfig(cache=str(cache), model=model, output=str(run_dir), num_layers=cfg.num_layers,
                       block_size=cfg.block_size, num_anchors=cfg.num_anchors, intermediate_size=cfg.intermediate_size,
                       mask_token_id=SMOLLM2_MASK_TOKEN_ID, lr=cfg.lr, batch_tokens=cfg.batch_tokens, steps=cfg.steps,
                       seed=cfg.seed, log_every=max(1, cfg.steps // 20), save_every=max(1, cfg.steps // 4))
    # Continue an interrupted run (its config.json is written before the first step); a fresh folder starts
    # without resume, which now refuses a folder that holds no run.
    result = train(tcfg, resume=(run_dir / "config.json").is_file(), device=cfg.device)
    if not result.finished or result.drafter_dir is None:
        raise ConfigError(f"training stopped at step {result.global_step}/{result.total_steps}; rerun to continue")
    return pathlib.Path(result.drafter_dir)


def _untrained(cfg: DemoConfig, *, trained: pathlib.Path, output: pathlib.Path) -> pathlib.Path:
    """A freshly initialised drafter with the trained one's config (same seed as the trained run's init)."""
    import torch

    from dflash.drafter.export import export_drafter, read_drafter_config
    from dflash.drafter.model import DFlashDrafter

    if (output / "config.json").is_file():
        return output
    dcfg = read_drafter_config(trained)
    torch.manual_seed(cfg.seed)
    return export_drafter(DFlashDrafter(dcfg), dcfg, output, dtype=torch.float32)


def _generate(cfg: DemoConfig, *, model: str, output: pathlib.Path) -> str:
    from dflash.data.assets import mtbench_questions_path
    from dflash.eval.generate import GenerateConfig, generate_file

    if output.is_file():  # written atomically: present means complete
        return f"reusing {output}"
    gcfg = GenerateConfig(max_new_tokens=cfg.max_new_tokens, batch_size=8, limit=cfg.eval_prompts)
    st = generate_file(model_path=model, prompts_path=mtbench_questions_path(), output_path=output, cfg=gcfg,
                       device=cfg.device, dtype=cfg.target_dtype)
    return (f"{st.prompts} responses: {st.stopped_at_eos} stopped at eos, {st.hit_max_tokens} hit max_new_tokens, "
            f"{st.response_tokens} response tokens")


def _evaluate(cfg: DemoConfig, *, drafters: dict[str, pathlib.Path], cache: pathlib.Path, model: str) -> list[dict]:
    from dflash.eval.evaluate import EvalConfig, evaluate_cache

    rows = []
    for name, d in drafters.items():
        res = evaluate_cache(drafter_dir=str(d), cache_dir=str(cache), model=model,
                             cfg=EvalConfig(device=cfg.device), progress=False)
        st = res.overall.to_json()
        tw = st["tau_token_weighted"]
        rows.append({"drafter": name, "tau": st["tau"], "accepted_per_step": None if tw is None else tw - 1.0,
                     "sequences": st["num_sequences"], "steps": st["num_steps"],
                     "response_tokens": st["response_tokens"], "exact": res.target_greedy, "drafter_dir": str(d)})
    return rows


def format_table(rows: list[dict]) -> str:
    """drafter | tau on MT-Bench | mean accepted draft tokens per target step | sequences | target steps."""
    lines = [f"{'drafter':<12} {'tau (MT-Bench)':>15} {'accepted/step':>14} {'samples':>8} {'steps':>7}"]
    for r in rows:
        acc = "-" if r["accepted_per_step"] is None else f"{r['accepted_per_step']:.3f}"
        lines.append(f"{r['drafter']:<12} {r['tau']:>15.3f} {acc:>14} {r['sequences']:>8} {r['steps']:>7}")
    return "\n".join(lines)


def run_demo(cfg: DemoConfig, echo: Callable[[str], None] = print, *, fresh: bool = False) -> DemoResult:
    """Run (or resume) the whole demo in cfg.output and return what it measured."""
    from dflash.target.assets import smollm2_hf_dir

    t0 = time.perf_counter()
    out = prepare_output(cfg, fresh=fresh)
    echo(f"dflash demo in {out} on {cfg.device}: {cfg.conversations} conversations, {cfg.steps} steps, "
         f"{cfg.num_layers}-layer drafter (block {cfg.block_size}), {cfg.eval_prompts} MT-Bench prompts")
    steps = _Steps(echo=echo, total=7)
    model = str(steps.run("convert", "SmolLM2-135M-Instruct: GGUF -> HF folder (cached)", smollm2_hf_dir))
    echo(f"target: {model}")

    conv = out / "conversations.jsonl"
    train_cache, eval_cache = out / "train_cache", out / "eval_cache"

    def extract_train():
        n = write_conversations(conv, count=cfg.conversations)
        echo(f"{n} ShareGPT conversations in {conv}")
        return _extract(cfg, model=model, data=conv, output=train_cache, max_length=cfg.max_length, echo=echo)

    steps.run("extract_train", f"extract the training cache ({cfg.conversations} ShareGPT conversations, bf16)",
              extract_train)
    trained = steps.run("train", f"train a drafter ({cfg.steps} steps)",
                        lambda: _train(cfg, model=model, cache=train_cache, run_dir=out / "train_run"))
    echo(f"trained drafter: {trained}")
    greedy = out / "mtbench_greedy.jsonl"
    echo_gen = steps.run("generate", f"target-greedy responses to {cfg.eval_prompts} MT-Bench prompts "
                                     f"(max {cfg.max_new_tokens} new tokens)",
                         lambda: _generate(cfg, model=model, output=greedy))
    echo(echo_gen)
    # eval sequences are prompt + response, never longer than the model's context; no truncation wanted
    steps.run("extract_eval", "extract the eval cache (target_greedy)",
              lambda: _extract(cfg, model=model, data=greedy, output=eval_cache, max_length=8192, echo=echo))

    def evaluate():
        untrained = _untrained(cfg, trained=trained, output=out / "untrained_drafter")
        return _evaluate(cfg, drafters={"untrained": untrained, "trained": trained}, cache=eval_cache, model=model)

    rows = steps.run("eval", "exact greedy tau: trained vs untrained drafter", evaluate)
    table = format_table(rows)
    seconds = round(time.perf_counter() - t0, 2)
    result = DemoResult(output=str(out), rows=rows, step_seconds=dict(steps.seconds), seconds=seconds,
                        config=cfg.settings(), table=table)
    replace_text(out / RESULT_FILE, json.dumps(result.to_json(), indent=2) + "\n")
    echo(f"\n=== [7/7] result ({seconds:.0f} s in all) ===\n{table}\nwritten to {out / RESULT_FILE}")
    return result
