"""Continuous decoding (greedy, or sampled: dflash.generate.sampling) with one KV-cache slot per conversation, for
Llama-family decoders.

Why not transformers' own continuous batching: without flash-attn it runs paged SDPA with no CUDA graphs and
reached 2.5-2.8K tok/s on the H200 (benchmarks/results/continuous_probe_h200.json), and HF's static-cache
generate runs round-synchronous batches (944 tok/s on whole ShareGPT conversations, regen_runs_h200.json).
Here:
- A slot is bound to a conversation (a `stream`) for its whole life: turn r+1's prompt extends turn r's
  context, so only the new ids (end of turn, next user turn, generation prompt) are prefilled; the KV of the
  history stays in the slot.
- Every decode step runs all slots at one fixed shape (slots x 1 token); a row that stops frees its slot for
  the next conversation at once instead of idling until the longest row of a batch ends. The fixed shape lets
  CUDA replay the step: `cuda_graphs` captures the eager step once per kv bucket (no compiler: the capture is
  one more step), `compile` runs it through torch.compile (minutes of compiles per bucket on the H200 first).
  The eager step is launch-bound (38 ms at 512 slots on the H200 whatever the kv length).
- Attention reads K/V once per KV head: the G query heads of a KV group are laid out as G x T query rows of
  that head (no repeat_kv copy of the cache), masked by position (key j visible to a query at position p iff
  j <= p), so positions past a slot's length (stale or padding) are never read.

The layer math is the model's own modules (norms, projections, RoPE, MLP) called in HF's order, so in fp32 the
responses equal HF generate's (tests). Supported: model types whose decoder layer is pre-norm attention + MLP
with plain RoPE (llama, mistral without a sliding window, qwen2, qwen3); others raise ConfigError (use the
static backend or an endpoint).
"""

from __future__ import annotations

import logging
import sys
import time
from collections import deque
from dataclasses import dataclass, field

from dflash.errors import ConfigError
from dflash.generate.decode import Decoded
from dflash.generate.sampling import pick_tokens, request_key

log = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def check_supported(config) -> None:
    """ConfigError unless the slot engine computes this model exactly as its HF class does."""
    mt = getattr(config, "model_type", None)
    if mt not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(f"the slot decoder supports {', '.join(SUPPORTED_MODEL_TYPES)} models, not {mt!r}: "
                          "use --backend static (or --endpoint with a serving engine)")
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        raise ConfigError(f"{mt} with a sliding window ({config.sliding_window}) is not supported by the slot "
                          "decoder: use --backend static")
    rs = getattr(config, "rope_scaling", None) or {}
    if rs.get("rope_type", rs.get("type", "default")) not in ("default", "llama3", "linear", "dynamic", None):
        raise ConfigError(f"rope scaling {rs!r} is not supported by the slot decoder: use --backend static")


def query_positions(pos_BT, *, groups: int):
    """Positions of the G x T query rows of one KV head (row g*T + t is token t of query head g)."""
    return pos_BT.repeat(1, groups)


def kv_bucket(n: int, *, cache_len: int, smallest: int = 256) -> int:
    """Positions attention reads for contexts of at most n ids: the next power of two from `smallest`, capped at
    cache_len (few distinct sizes, so few compiled decode graphs; on average well under the full cache)."""
    b = smallest
    while b < n:
        b *= 2
    return min(b, cache_len)


def prefill_batches(lengths: list[int], *, budget: int, spread: float = 2.0) -> list[list[int]]:
    """Indices of `lengths` grouped into prefill batches: shortest first, each padded batch (rows x longest) within
    `budget` ids (a row longer than the budget alone), and no row more than `spread` x the batch's shortest, so
    padding stays under half the work while short rows still share a call (an eager prefill has a fixed cost)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    out: list[list[int]] = []
    for i in order:
        b = out[-1] if out else None
        if b and (len(b) + 1) * lengths[i] <= budget and lengths[i] <= spread * max(lengths[b[0]], 1):
            b.append(i)
        else:
            out.append([i])
    return out


def visible_mask(pos_BQ, *, cache_len: int):
    """[B, 1, Q, L] bool: key j visible to a query at position p iff j <= p (causal within a prefill too)."""
    import torch

    keys = torch.arange(cache_len, device=pos_BQ.device)
    return (keys[None, None, None, :] <= pos_BQ[:, None, :, None])


@dataclass(kw_only=True)
class _Slot:
    stream: object = None
    """The conversation bound to this slot (None: free)."""
    ctx: list = field(default_factory=list)
    """Ids whose K/V are in the slot before the current request's decode steps (those are out[:n_out - 1])."""
    key: str | None = None
    """The request being served."""
    todo: list = field(default_factory=list)
    """Ids to prefill before decoding."""


def counters_line(c: dict, *, slots: int) -> str:
    """One line of SlotEngine.counters: where the engine's time went."""
    occ = c["decode_rows"] / (c["decode_steps"] * slots) if c["decode_steps"] else 0.0
    ms = 1000 * c["decode_s"] / c["decode_steps"] if c["decode_steps"] else 0.0
    pad = c["prefill_tokens"] / c["prefill_padded_tokens"] if c["prefill_padded_tokens"] else 1.0
    return (f"slot engine: {c['decode_steps']:,} decode steps in {c['decode_s']:.1f} s ({ms:.1f} ms each, "
            f"{occ:.0%} of {slots} slots busy), {c['prefill_calls']:,} prefills of {c['prefill_rows']:,} rows in "
            f"{c['prefill_s']:.1f} s ({c['prefill_tokens']:,} ids, {pad:.0%} of the padded batches)")


class SlotDecoder:
    """The model's layers over a per-slot KV cache: prefill(ids per slot) and a fixed-shape decode step."""

    def __init__(self, model, *, slots: int, cache_len: int, compile: bool, decode_bmm: bool = False,
                 compile_mode: str = "reduce-overhead", cuda_graphs: bool = False, temperature: float = 0.0) -> None:
        import torch

        check_supported(model.config)
        self.model = model
        inner = model.model
        cfg = model.config
        attn = inner.layers[0].self_attn
        self.head_dim = int(attn.head_dim)
        self.kv_heads = int(cfg.num_key_value_heads)
        self.groups = int(cfg.num_attention_heads) // self.kv_heads
        self.scaling = float(attn.scaling)
        self.rope = sys.modules[type(attn).__module__].apply_rotary_pos_emb
        self.slots = slots
        self.cache_len = cache_len
        p = next(model.parameters())
        shape = (len(inner.layers), slots, self.kv_heads, cache_len, self.head_dim)
        self.k = torch.zeros(shape, dtype=p.dtype, device=p.device)
        self.v = torch.zeros(shape, dtype=p.dtype, device=p.device)
        self.device = p.device
        self.decode_bmm = decode_bmm
        self.temperature = float(temperature)
        # each slot's request stream id (dflash.generate.sampling.request_key), set as a request starts; read in
        # place by the decode step, so a captured graph sees the current ones
        self.key_S = torch.zeros(slots, dtype=torch.int64, device=p.device)
        self._decode = self._forward_all
        self._compiled = self._compiled_ok = False
        # kv_len -> (graph, token input, position input, output): the step captured with static buffers
        self._graphs: dict[int, tuple] = {}
        self._graph_pool = None
        self.cuda_graphs = bool(cuda_graphs) and p.device.type == "cuda" and not compile
        if compile and p.device.type == "cuda":
            torch._dynamo.mark_static_address(self.k)
            torch._dynamo.mark_static_address(self.v)
            # one graph per kv_len bucket (a handful: kv_bucket's powers of two)
            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 16)
            self._decode = torch.compile(self._forward_all, mode=compile_mode, dynamic=False, fullgraph=False)
            self._compiled = True

    def _attend(self, qg, kc, vc, mask, *, bmm: bool):
        """Attention of the G x T query rows of each KV head over that head's keys; bmm: the scores as one
        batched matmul + softmax (decode rows are few per head: no kernel choice, fuses under compile)."""
        import torch
        import torch.nn.functional as F

        if not bmm:
            return F.scaled_dot_product_attention(qg, kc, vc, attn_mask=mask, scale=self.scaling)
        s = torch.matmul(qg, kc.transpose(-1, -2)) * self.scaling
        s = s.masked_fill(~mask, float("-inf")).softmax(dim=-1, dtype=torch.float32).to(vc.dtype)
        return torch.matmul(s, vc)

    def _layers(self, h_BTH, pos_BT, slot_B, *, kv_len: int, decode: bool):
        """decode: every slot in slot order (views of the cache, no gather); else the rows slot_B. Attention reads
        the first kv_len positions of each slot: every query position must be below it."""
        inner = self.model.model
        B, T, _ = h_BTH.shape
        D, Hk, G, L = self.head_dim, self.kv_heads, self.groups, self.cache_len
        cos, sin = inner.rotary_emb(h_BTH, pos_BT)
        mask = visible_mask(query_positions(pos_BT, groups=G), cache_len=kv_len)
        wpos = pos_BT.clamp(max=L - 1)  # padding rows of a prefill past the end write garbage no query reads
        rows = slot_B[:, None].expand(B, T)
        for li, layer in enumerate(inner.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h_BTH)
            q = attn.q_proj(x).view(B, T, -1, D)
            k = attn.k_proj(x).view(B, T, -1, D)
            v = attn.v_proj(x).view(B, T, -1, D)
            if hasattr(attn, "q_norm"):  # qwen3: RMSNorm over the head dim before RoPE
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = self.rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
            self.k[li][rows, :, wpos] = k.transpose(1, 2)
            self.v[li][rows, :, wpos] = v
            kc = self.k[li][:, :, :kv_len] if decode else self.k[li][slot_B, :, :kv_len]
            vc = self.v[li][:, :, :kv_len] if decode else self.v[li][slot_B, :, :kv_len]
            qg = q.reshape(B, Hk, G * T, D)  # head h = kv*G + g (repeat_kv's order): rows g*T + t of kv head
            o = self._attend(qg, kc, vc, mask, bmm=decode and self.decode_bmm)
            o = o.reshape(B, Hk * G, T, D).transpose(1, 2).reshape(B, T, Hk * G * D)
            h_BTH = h_BTH + attn.o_proj(o)
            h_BTH = h_BTH + layer.mlp(layer.post_attention_layernorm(h_BTH))
        return inner.norm(h_BTH)

    def _forward_all(self, tok_S1, pos_S1, kv_len: int):
        import torch

        slot_S = torch.arange(self.slots, device=tok_S1.device)
        h = self._layers(self.model.model.embed_tokens(tok_S1), pos_S1, slot_S, kv_len=kv_len, decode=True)
        return pick_tokens(self.model.lm_head(h[:, -1]), temperature=self.temperature, key_B=self.key_S,
                           pos_B=pos_S1[:, -1])

    def decode(self, tok_S, pos_S, *, kv_len: int | None = None):
        """One token for every slot: tok_S fed at position pos_S; returns the next token per slot (greedy, or
        sampled at `temperature` with each slot's key_S).
        kv_len (default cache_len; kv_bucket of the longest live context) bounds the positions attention reads:
        a slot whose position is not below it gets a meaningless token."""
        import torch

        kv_len = self.cache_len if kv_len is None else kv_len
        tok_S1, pos_S1 = tok_S[:, None], pos_S[:, None]
        with torch.no_grad():
            if not self.cuda_graphs and (not self._compiled or self._compiled_ok):
                return self._decode(tok_S1, pos_S1, kv_len)
            # a graph step, or the first compiled call: a capture or compiler failure falls back to the eager
            # step, which is exact
            try:
                if self.cuda_graphs:
                    return self._replay(tok_S1, pos_S1, kv_len)
                out = self._decode(tok_S1, pos_S1, kv_len)
                self._compiled_ok = True
                return out
            except Exception as e:  # noqa: BLE001 - any capture/inductor/dynamo failure
                what = "capturing the decode step as a CUDA graph" if self.cuda_graphs else "compiling the decode step"
                log.warning("slot decoder: %s failed (%s: %s); running it eagerly", what, type(e).__name__,
                            str(e).splitlines()[0] if str(e) else "")
                self.cuda_graphs, self._graphs = False, {}
                self._decode, self._compiled = self._forward_all, False
                return self._forward_all(tok_S1, pos_S1, kv_len)

    def _replay(self, tok_S1, pos_S1, kv_len: int):
        """The decode step as a CUDA graph of this kv_len (captured on first use). The warm-up and the capture
        write the K/V of the same tokens at the same positions as the step itself, so they change nothing."""
        import torch

        g = self._graphs.get(kv_len)
        if g is None:
            tok_in, pos_in = tok_S1.clone(), pos_S1.clone()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # allocator and library handles settle outside the capture
                for _ in range(2):
                    self._forward_all(tok_in, pos_in, kv_len)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # one memory pool for every bucket: graphs replay one at a time and each output is copied at once
            with torch.cuda.graph(graph, pool=self._graph_pool):
                out = self._forward_all(tok_in, pos_in, kv_len)
            self._graph_pool = graph.pool()
            g = self._graphs[kv_len] = (graph, tok_in, pos_in, out)
        graph, tok_in, pos_in, out = g
        tok_in.copy_(tok_S1)
        pos_in.copy_(pos_S1)
        graph.replay()
        return out.clone()

    def prefill(self, slot_ids: list[int], ids: list[list[int]], starts: list[int]):
        """ids[b] written into slot slot_ids[b] from position starts[b]; returns the token after each (as decode)."""
        import torch

        B, T = len(ids), max(len(x) for x in ids)
        tok = torch.zeros((B, T), dtype=torch.long)
        pos = torch.zeros((B, T), dtype=torch.long)
        for b, (x, s) in enumerate(zip(ids, starts)):
            tok[b, : len(x)] = torch.tensor(x, dtype=torch.long)
            pos[b] = torch.arange(s, s + T)
        last = torch.tensor([len(x) - 1 for x in ids], device=self.device)
        last_pos = torch.tensor([s + len(x) - 1 for x, s in zip(ids, starts)], device=self.device)
        with torch.no_grad():
            slot_B = torch.tensor(slot_ids, device=self.device)
            h = self._layers(self.model.model.embed_tokens(tok.to(self.device)), pos.to(self.device), slot_B,
                             kv_len=kv_bucket(max(s + T for s in starts), cache_len=self.cache_len), decode=False)
            return pick_tokens(self.model.lm_head(h[torch.arange(B, device=self.device), last]),
                               temperature=self.temperature, key_B=self.key_S[slot_B], pos_B=last_pos)


class SlotEngine:
    """dflash.generate.continuous's engine interface (submit / next_result / release / close) on a SlotDecoder.

    submit(key, ids, budget, stream=S): when S holds a slot whose context is a prefix of ids, only the rest is
    prefilled; release(S) frees the slot (the conversation is over).

    Per-slot decode state lives in arrays (position, last token, tokens out, budget, live), so a decode step's host
    work is a few vector operations plus Python only for the requests that finish: at 512 slots the per-row
    Python of a list-based step cost about as much as the GPU step."""

    def __init__(self, model, *, stop_ids, slots: int, cache_len: int, compile: bool = False,
                 decode_bmm: bool = False, prefill_tokens: int = 16384, cuda_graphs: bool = False,
                 temperature: float = 0.0, seed: int = 0) -> None:
        import numpy as np

        self.dec = SlotDecoder(model, slots=slots, cache_len=cache_len, compile=compile, decode_bmm=decode_bmm,
                               cuda_graphs=cuda_graphs, temperature=temperature)
        self.seed = int(seed)
        self.stop_arr = np.array(sorted({int(i) for i in stop_ids}), dtype=np.int64)
        self.slots = [_Slot() for _ in range(slots)]
        self.pos = np.zeros(slots, np.int64)
        """Where each slot's next fed token goes: len(ctx) + n_out - 1 while decoding, len(ctx) otherwise."""
        self.last = np.zeros(slots, np.int64)
        """The token each decoding slot feeds next (its latest generated token)."""
        self.out = np.zeros((slots, cache_len), np.int64)
        self.n_out = np.zeros(slots, np.int64)
        self.budget = np.zeros(slots, np.int64)
        self.live = np.zeros(slots, bool)
        """Decoding: a request whose prompt is prefilled and which has not finished."""
        self.free = deque(range(slots))
        self.prefill_wait: set[int] = set()
        """Slots whose request waits for its prefill."""
        self.by_stream: dict = {}
        self.waiting: deque = deque()
        self.results: deque = deque()
        self.prefill_tokens = prefill_tokens
        self.min_prefill_rows = max(1, slots // 16)
        """Rows waiting before a prefill runs while others decode (prefill rarely, not after every finish)."""
        self.counters = dict(decode_steps=0, decode_rows=0, decode_s=0.0, prefill_calls=0, prefill_rows=0,
                             prefill_tokens=0, prefill_padded_tokens=0, prefill_s=0.0)
        """Where the time goes (each call ends in a host copy of its tokens, so the seconds include the GPU's):
        decode_rows / (decode_steps x slots) is the slot occupancy; prefill_tokens counts ids prefilled (a later
        turn on a kept slot adds only its new ids), prefill_padded_tokens what the padded batches computed."""

    def submit(self, key: str, prompt_ids: list[int], budget: int, *, stream=None) -> None:
        assert len(prompt_ids) + budget <= self.dec.cache_len, "prompt + budget exceed the slot length"
        s = self.by_stream.get(stream) if stream is not None else None
        if s is None:
            self.waiting.append((key, list(prompt_ids), int(budget), stream))
            return
        self._start(s, key, list(prompt_ids), int(budget))

    def _start(self, s: int, key: str, ids: list[int], budget: int) -> None:
        slot = self.slots[s]
        n = len(slot.ctx)
        if n >= len(ids) or ids[:n] != slot.ctx:  # not an extension of the slot's context: start over
            n = 0
            slot.ctx = []
        slot.key, slot.todo = key, ids[n:]
        self.pos[s], self.n_out[s], self.budget[s], self.live[s] = n, 0, budget, False
        if self.dec.temperature > 0:
            self.dec.key_S[s] = request_key(self.seed, key)
        self.prefill_wait.add(s)

    def _reset(self, s: int) -> None:
        self.slots[s] = _Slot()
        self.pos[s], self.n_out[s], self.live[s] = 0, 0, False
        self.prefill_wait.discard(s)
        self.free.append(s)

    def release(self, stream) -> None:
        s = self.by_stream.pop(stream, None)
        if s is not None:
            self._reset(s)

    def _admit(self) -> None:
        while self.waiting and self.free:
            key, ids, budget, stream = self.waiting.popleft()
            s = self.free.popleft()
            self.slots[s].stream = stream if stream is not None else object()
            if stream is not None:
                self.by_stream[stream] = s
            self._start(s, key, ids, budget)

    def _finish(self, s: int, *, stop: bool) -> None:
        """Slot s's request ended at its latest token (stop: a stop token, else its budget): its result, and the
        fed tokens (all generated but the last) join the slot's context."""
        slot, n = self.slots[s], int(self.n_out[s])
        ids = self.out[s, :n].tolist()
        self.results.append((slot.key, Decoded(response_ids=ids, stop_reason="eos" if stop else "length")))
        slot.ctx.extend(ids[:-1])
        slot.key = None
        self.live[s], self.n_out[s], self.pos[s] = False, 0, len(slot.ctx)
        if slot.stream not in self.by_stream:
            self._reset(s)  # an anonymous request: free at once

    def _emitted(self, rows, tokens) -> None:
        """Append tokens[i] to the output of slot rows[i] (all decoding); finish those at a stop or budget."""
        import numpy as np

        self.out[rows, self.n_out[rows]] = tokens
        self.n_out[rows] += 1
        self.last[rows] = tokens
        stop = np.isin(tokens, self.stop_arr)
        done = stop | (self.n_out[rows] >= self.budget[rows])
        for s, at_stop in zip(rows[done].tolist(), stop[done].tolist()):
            self._finish(s, stop=at_stop)

    def _prefill(self) -> None:
        import numpy as np

        todo = sorted(self.prefill_wait)
        for group in prefill_batches([len(self.slots[s].todo) for s in todo], budget=self.prefill_tokens):
            batch = [todo[j] for j in group]
            t0 = time.perf_counter()
            nxt = self.dec.prefill(batch, [self.slots[s].todo for s in batch],
                                   [len(self.slots[s].ctx) for s in batch]).cpu().numpy()
            c = self.counters
            c["prefill_s"] += time.perf_counter() - t0
            c["prefill_calls"] += 1
            c["prefill_rows"] += len(batch)
            c["prefill_padded_tokens"] += len(batch) * max(len(self.slots[s].todo) for s in batch)
            for s in batch:
                c["prefill_tokens"] += len(self.slots[s].todo)
                self.slots[s].ctx.extend(self.slots[s].todo)
                self.slots[s].todo = []
                self.pos[s] = len(self.slots[s].ctx)
                self.live[s] = True
                self.prefill_wait.discard(s)
            self._emitted(np.array(batch, dtype=np.int64), nxt.astype(np.int64))

    def _step(self) -> None:
        import numpy as np
        import torch

        live = np.flatnonzero(self.live)
        assert live.size, "a decode step with no request decoding"
        # idle rows feed a dummy token at their next free position: overwritten before anything reads it
        tok = np.where(self.live, self.last, 0)
        kv_len = kv_bucket(int(self.pos[live].max()) + 1, cache_len=self.dec.cache_len)
        dev = self.dec.device
        t0 = time.perf_counter()
        nxt = self.dec.decode(torch.from_numpy(tok).to(dev), torch.from_numpy(self.pos.copy()).to(dev),
                              kv_len=kv_len).cpu().numpy()
        c = self.counters
        c["decode_s"] += time.perf_counter() - t0
        c["decode_steps"] += 1
        c["decode_rows"] += int(live.size)
        self.pos[live] += 1  # the fed token is in the cache now
        self._emitted(live, nxt[live].astype(np.int64))

    def next_result(self) -> tuple[str, Decoded]:
        while not self.results:
            self._admit()
            waiting, decoding = len(self.prefill_wait), int(self.live.sum())
            # an eager prefill costs about a decode step whatever its size: gather a few rows per prefill
            if waiting and (waiting >= self.min_prefill_rows or not decoding):
                self._prefill()
            elif decoding:
                self._step()
            else:
                raise AssertionError("next_result() with nothing submitted")
        return self.results.popleft()

    def close(self) -> None:
        self.dec = None
