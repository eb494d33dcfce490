"""DFlashDrafter: tensor names, the packed masked training forward against per-block runs, and the z-lab
single-block decode step re-implemented from method doc 6 with transformers' own Qwen3 RoPE and RMSNorm."""

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, Qwen3RotaryEmbedding, apply_rotary_pos_emb

from dflash.drafter.config import DrafterConfig
from dflash.drafter.model import DFlashDrafter
from dflash.train.objective import build_blocks, packed_layout, sample_anchors

B = 4
K_TAPS = 3


def tiny_cfg(**kw):
    base = dict(hidden_size=32, intermediate_size=48, target_layer_ids=(1, 3, 5), num_target_layers=8,
                mask_token_id=3, vocab_size=40, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=8, block_size=B, rope_theta=1e4, max_position_embeddings=512)
    base.update(kw)
    return DrafterConfig(**base)


def tiny_model(seed=0, **kw):
    torch.manual_seed(seed)
    m = DFlashDrafter(tiny_cfg(**kw)).double()
    with torch.no_grad():   # non-trivial norm weights so a wrong norm placement shows up
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return m


def published_names(num_layers):
    names = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for i in range(num_layers):
        for p in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
            names.add(f"layers.{i}.self_attn.{p}.weight")
        for p in ("gate_proj", "up_proj", "down_proj"):
            names.add(f"layers.{i}.mlp.{p}.weight")
        names.add(f"layers.{i}.input_layernorm.weight")
        names.add(f"layers.{i}.post_attention_layernorm.weight")
    return names


def test_tensor_names_and_shapes_match_published_drafters():
    cfg = DrafterConfig(hidden_size=64, intermediate_size=96, target_layer_ids=(1, 9, 17, 25, 33),
                        num_target_layers=36, mask_token_id=5, vocab_size=100, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16)
    sd = DFlashDrafter(cfg).state_dict()
    assert set(sd) == published_names(5)
    assert sd["fc.weight"].shape == (64, 5 * 64)
    assert sd["layers.0.self_attn.q_proj.weight"].shape == (4 * 16, 64)
    assert sd["layers.0.self_attn.k_proj.weight"].shape == (2 * 16, 64)
    assert sd["layers.0.self_attn.o_proj.weight"].shape == (64, 4 * 16)
    assert sd["layers.0.self_attn.q_norm.weight"].shape == (16,)
    assert sd["layers.0.mlp.gate_proj.weight"].shape == (96, 64)
    assert sd["layers.0.mlp.down_proj.weight"].shape == (64, 96)


def test_published_qwen3_8b_parameter_count():
    # method doc 1.2: ~1.05B trainable for the Qwen3-8B drafter (fc 83.9M, 192.9M per layer)
    cfg = DrafterConfig(hidden_size=4096, intermediate_size=12288, target_layer_ids=(1, 9, 17, 25, 33),
                        num_target_layers=36, mask_token_id=151669, vocab_size=151936, rope_theta=1e6)
    with torch.device("meta"):
        m = DFlashDrafter(cfg)
    n = sum(p.numel() for p in m.parameters())
    assert abs(n - 1.049e9) < 0.01e9


# ------------------------------------------------------------------------------------- packed batch setup

def packed_case(seed=0):
    """Two sequences packed together, with anchors near both ends and a hole in the loss mask."""
    g = torch.Generator().manual_seed(seed)
    lengths = [13, 9]
    masks = [torch.tensor([0, 0, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1]), torch.tensor([1, 1, 1, 1, 1, 1, 1, 1, 1])]
    ids = [torch.randint(0, 40, (n,), generator=g) for n in lengths]
    anchors = [sample_anchors(masks[0], num_anchors=6, generator=g), torch.tensor([0, 2, 5, 7])]
    feats = [torch.randn(n, K_TAPS, 32, generator=g, dtype=torch.float64) for n in lengths]
    return lengths, ids, masks, anchors, feats


def embed(ids, seed=1):
    table = torch.randn(40, 32, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return table[ids]


def packed_forward(model, lengths, ids, masks, anchors, feats):
    lay = packed_layout(lengths=lengths, anchors=anchors, block_size=B)
    blocks = [build_blocks(i, m, a, block_size=B, mask_token_id=3) for i, m, a in zip(ids, masks, anchors)]
    block_ids = torch.cat([b.block_ids_JB for b in blocks]).flatten()
    assert torch.equal(torch.cat([b.positions_JB for b in blocks]).flatten(), lay.q_pos_Q)
    dtype = next(model.parameters()).dtype
    ctx = model.context(torch.cat(feats).to(dtype))
    out = model(embed(block_ids).to(dtype), ctx, q_pos=lay.q_pos_Q, kv_pos=lay.kv_pos_K, mask=lay)
    return out.view(-1, B, 32)


def isolated_forward(model, ids_s, feat_s, a):
    """One block run alone with only its visible context (positions < a of its own sequence), no mask."""
    block_ids = torch.tensor([ids_s[a].item()] + [3] * (B - 1))
    ctx = model.context(feat_s[:a])
    q_pos = a + torch.arange(B)
    return model(embed(block_ids), ctx, q_pos=q_pos, kv_pos=torch.cat([torch.arange(a), q_pos]), mask=None)


@pytest.mark.parametrize("chunk_tokens", [B, 3 * B, 4096])
def test_packed_masked_forward_equals_each_block_alone(chunk_tokens):
    model = tiny_model()
    model.dense_chunk_tokens = chunk_tokens
    lengths, ids, masks, anchors, feats = packed_case()
    with torch.no_grad():
        out_JBD = packed_forward(model, lengths, ids, masks, anchors, feats)
        j = 0
        for s in range(2):
            for a in anchors[s].tolist():
                ref = isolated_forward(model, ids[s], feats[s], a)
                torch.testing.assert_close(out_JBD[j], ref, rtol=1e-10, atol=1e-10)
                j += 1
    assert j == out_JBD.shape[0]


def test_no_leakage_from_future_context_other_sequences_or_other_blocks():
    model = tiny_model(seed=2)
    lengths, ids, masks, anchors, feats = packed_case(seed=3)
    with torch.no_grad():
        base = packed_forward(model, lengths, ids, masks, anchors, feats)
        a = anchors[0][1].item()          # block 1 of sequence 0
        j = 1
        # perturb: seq-0 context at positions >= a, all of seq 1, and the anchor tokens of every other block
        f2 = [feats[0].clone(), feats[1] + 5.0]
        f2[0][a:] += 7.0
        ids2 = [ids[0].clone(), (ids[1] + 1) % 40]
        others = [x for i, x in enumerate(anchors[0].tolist()) if i != j]
        ids2[0][others] = (ids2[0][others] + 1) % 40
        ids2[0][a] = ids[0][a]
        out = packed_forward(model, lengths, ids2, masks, anchors, f2)
        torch.testing.assert_close(out[j], base[j], rtol=0, atol=1e-12)
        # sanity: the perturbation did reach other blocks, and visible context does matter
        assert not torch.allclose(out[0], base[0]) or not torch.allclose(out[-1], base[-1])
        f3 = [feats[0].clone(), feats[1]]
        f3[0][a - 1] += 1.0
        out3 = packed_forward(model, lengths, ids, masks, anchors, f3)
        assert (out3[j] - base[j]).abs().max() > 1e-3


def test_dense_chunked_gradients_match_single_chunk():
    lengths, ids, masks, anchors, feats = packed_case(seed=4)
    grads = []
    for chunk in (B, 4096):
        model = tiny_model(seed=5)
        model.dense_chunk_tokens = chunk
        out = packed_forward(model, lengths, ids, masks, anchors, feats)
        (out.pow(2).sum() + out.sum()).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for n in grads[0]:
        torch.testing.assert_close(grads[0][n], grads[1][n], rtol=1e-9, atol=1e-12, msg=n)
    assert grads[0]["fc.weight"].abs().sum() > 0


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_flex_mask_mod_matches_dense_on_cpu_forward():
    # Uncompiled flex attention runs forward on CPU: it checks the mask_mod wiring of the shared predicate.
    model = tiny_model(seed=6).float()
    lengths, ids, masks, anchors, feats = packed_case(seed=6)
    feats = [f.float() for f in feats]
    lay = packed_layout(lengths=lengths, anchors=anchors, block_size=B)
    block_ids = torch.cat([build_blocks(i, m, a, block_size=B, mask_token_id=3).block_ids_JB
                           for i, m, a in zip(ids, masks, anchors)]).flatten()
    with torch.no_grad():
        ctx = model.context(torch.cat(feats))
        emb = embed(block_ids).float()
        dense = model(emb, ctx, q_pos=lay.q_pos_Q, kv_pos=lay.kv_pos_K, mask=lay)
        model.attn_backend = "flex"
        flex = model(emb, ctx, q_pos=lay.q_pos_Q, kv_pos=lay.kv_pos_K, mask=lay)
    torch.testing.assert_close(flex, dense, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------ z-lab decode step (method doc 6)

def zlab_decode_step(model, cfg, feat_SKD, ids_S, a):
    """Straight re-implementation of one z-lab decode step (dflash/model.py lines 107-148, 176-347) for the
    block anchored at a, written from the method doc with transformers' Qwen3 RoPE and RMSNorm."""
    sd = {k: v for k, v in model.state_dict().items()}
    H, nh, nkv, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim

    def rms(x, w, dim):
        n = Qwen3RMSNorm(dim, eps=cfg.rms_norm_eps).double()
        n.weight.data.copy_(w)
        return n(x)

    qcfg = Qwen3Config(hidden_size=H, num_attention_heads=nh, num_key_value_heads=nkv, head_dim=d,
                       rope_theta=cfg.rope_theta, max_position_embeddings=cfg.max_position_embeddings)
    rotary = Qwen3RotaryEmbedding(qcfg)
    target_hidden = feat_SKD[:a].reshape(1, a, -1)                            # context: features < a
    ctx = rms(target_hidden @ sd["fc.weight"].T, sd["hidden_norm.weight"], H)   # [1, a, H]
    x = embed(torch.tensor([ids_S[a].item()] + [cfg.mask_token_id] * (cfg.block_size - 1)))[None]
    q_len = x.shape[1]
    position_ids = torch.arange(a + q_len)[None]                             # [ctx; block] positions
    cos, sin = rotary(x, position_ids)
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        h = rms(x, sd[p + "input_layernorm.weight"], H)
        q = (h @ sd[p + "self_attn.q_proj.weight"].T).view(1, q_len, nh, d)
        q = rms(q, sd[p + "self_attn.q_norm.weight"], d).transpose(1, 2)
        k = torch.cat([ctx @ sd[p + "self_attn.k_proj.weight"].T, h @ sd[p + "self_attn.k_proj.weight"].T], 1)
        v = torch.cat([ctx @ sd[p + "self_attn.v_proj.weight"].T, h @ sd[p + "self_attn.v_proj.weight"].T], 1)
        k = rms(k.view(1, a + q_len, nkv, d), sd[p + "self_attn.k_norm.weight"], d).transpose(1, 2)
        v = v.view(1, a + q_len, nkv, d).transpose(1, 2)
        q, _ = apply_rotary_pos_emb(q, q, cos[:, -q_len:], sin[:, -q_len:])   # q: last q_len positions
        k, _ = apply_rotary_pos_emb(k, k, cos, sin)                           # k: all positions
        k = k.repeat_interleave(nh // nkv, dim=1)
        v = v.repeat_interleave(nh // nkv, dim=1)
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d), dim=-1)    # is_causal=False, no mask
        o = (att @ v).transpose(1, 2).reshape(1, q_len, nh * d)
        x = x + o @ sd[p + "self_attn.o_proj.weight"].T
        h = rms(x, sd[p + "post_attention_layernorm.weight"], H)
        mlp = F.silu(h @ sd[p + "mlp.gate_proj.weight"].T) * (h @ sd[p + "mlp.up_proj.weight"].T)
        x = x + mlp @ sd[p + "mlp.down_proj.weight"].T
    return rms(x, sd["norm.weight"], H)[0]


def test_packed_forward_reproduces_zlab_decode_step():
    model = tiny_model(seed=7)
    cfg = model.cfg
    lengths, ids, masks, anchors, feats = packed_case(seed=7)
    with torch.no_grad():
        out = packed_forward(model, lengths, ids, masks, anchors, feats)
        # block 2 of sequence 0, and block 2 of sequence 1 (anchor 5), which follows sequence 0's blocks
        for j, s in ((2, 0), (anchors[0].numel() + 2, 1)):
            a = anchors[s][2].item()
            ref = zlab_decode_step(model, cfg, feats[s], ids[s], a)
            torch.testing.assert_close(out[j], ref, rtol=1e-9, atol=1e-9)


def test_drafter_output_is_final_normed_and_context_shape():
    model = tiny_model()
    ctx = model.context(torch.randn(5, K_TAPS, 32, dtype=torch.float64))
    assert ctx.shape == (5, 32)
    q_pos = torch.arange(5, 5 + B)
    out = model(torch.randn(B, 32, dtype=torch.float64), ctx, q_pos=q_pos,
                kv_pos=torch.cat([torch.arange(5), q_pos]))
    normed = out / model.norm.weight
    torch.testing.assert_close(normed.pow(2).mean(-1), torch.ones(B, dtype=torch.float64), rtol=1e-4, atol=1e-4)


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
def test_flex_compiled_matches_dense_on_cuda_forward_and_backward():
    dev = torch.device("cuda")
    lengths, ids, masks, anchors, feats = packed_case(seed=8)
    results = []
    for backend in ("dense", "flex"):
        model = tiny_model(seed=9, num_attention_heads=4, num_key_value_heads=2, head_dim=16).float().to(dev)
        model.attn_backend = backend
        lay = packed_layout(lengths=lengths, anchors=[a.to(dev) for a in anchors], block_size=B)
        block_ids = torch.cat([build_blocks(i, m, a, block_size=B, mask_token_id=3).block_ids_JB
                               for i, m, a in zip(ids, masks, anchors)]).flatten()
        ctx = model.context(torch.cat(feats).float().to(dev))
        out = model(embed(block_ids).float().to(dev), ctx, q_pos=lay.q_pos_Q, kv_pos=lay.kv_pos_K, mask=lay)
        out.pow(2).sum().backward()
        results.append((out.detach(), {n: p.grad for n, p in model.named_parameters()}))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=2e-3, atol=2e-3)
    for n, g in results[0][1].items():
        torch.testing.assert_close(results[1][1][n], g, rtol=2e-2, atol=2e-3, msg=n)


def test_tiny_training_run_overfits_one_packed_batch():
    # Everything together: anchors -> blocks -> packed masked forward -> frozen head -> chunked CE -> AdamW.
    from dflash.train.objective import chunked_ce_loss

    torch.manual_seed(10)
    model = DFlashDrafter(tiny_cfg())
    lengths, ids, masks, anchors, feats = packed_case(seed=10)
    feats = [f.float() for f in feats]
    lay = packed_layout(lengths=lengths, anchors=anchors, block_size=B)
    blocks = [build_blocks(i, m, a, block_size=B, mask_token_id=3) for i, m, a in zip(ids, masks, anchors)]
    block_ids = torch.cat([b.block_ids_JB for b in blocks]).flatten()
    labels = torch.cat([b.labels_JB for b in blocks]).flatten()
    weights = torch.cat([b.weights_JB for b in blocks]).flatten()
    table = embed(torch.arange(40)).float()
    head = torch.randn(40, 32, generator=torch.Generator().manual_seed(2))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(60):
        out = model(table[block_ids], model.context(torch.cat(feats)), q_pos=lay.q_pos_Q, kv_pos=lay.kv_pos_K,
                    mask=lay)
        res = chunked_ce_loss(out, head, labels, weights, chunk=8, block_size=B)
        opt.zero_grad()
        res.loss.backward()
        opt.step()
        losses.append(res.loss.item())
    assert losses[-1] < 0.2 * losses[0]
    assert res.correct_B[1:].sum() / res.count_B[1:].sum() > 0.9
    assert res.accept_len.item() > 2.5


def test_bf16_dense_path_runs_and_tracks_fp32():
    model = tiny_model(seed=11).float()
    case = packed_case(seed=11)
    with torch.no_grad():
        out32 = packed_forward(model, *case)
        out16 = packed_forward(model.to(torch.bfloat16), *case)
    assert out16.dtype == torch.bfloat16
    assert (out16.float() - out32).abs().max() < 0.1


def test_fp32_weights_under_bf16_autocast():
    model = tiny_model(seed=12).float()
    case = packed_case(seed=12)
    with torch.no_grad():
        ref = packed_forward(model, *case)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = packed_forward(model, *case)
    assert (out.float() - ref).abs().max() < 0.1


def test_rms_norm_output_stays_in_input_dtype_under_autocast():
    """fp32 master weight x bf16 activations: bf16 out (as the exported drafter computes in bf16)."""
    from dflash.drafter.model import RMSNorm

    norm = RMSNorm(16, 1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(5, 16).to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = norm(x)
    assert y.dtype == torch.bfloat16
    ref = Qwen3RMSNorm(16, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        ref.weight.copy_(norm.weight)
    torch.testing.assert_close(y, ref(x), rtol=0, atol=0)


def test_compiled_elementwise_matches_eager_forward_and_backward():
    """compile_elementwise swaps the norms, RoPE and SiLU-gating for torch.compile'd kernels: same outputs
    and gradients up to float rounding. The norm computes in fp32 by design (Qwen3RMSNorm), and inductor may
    skip an fp32 rounding step that eager takes, so the tolerance is fp32's, not the fp64 model's."""
    case = packed_case(seed=21)
    grads, outs = [], []
    for compiled in (False, True):
        model = tiny_model(seed=21)
        if compiled:
            model.compile_elementwise()
        out = packed_forward(model, *case)
        out.pow(2).sum().backward()
        outs.append(out.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-6)
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        scale = grads[0][name].abs().max().item()
        assert (grads[1][name] - grads[0][name]).abs().max().item() <= 1e-5 * scale + 1e-9, name


def test_eager_elementwise_rebinds_the_eager_ops_for_its_duration():
    """Evaluation runs a compiled training drafter's element-wise ops eagerly (the exported drafter's floats);
    the compiled kernels are bound again after, also when the body raises."""
    from dflash.compiled import compiled_op
    from dflash.drafter.model import apply_rope, rms_norm, silu_mul

    model = tiny_model(seed=3)
    with model.eager_elementwise():  # never compiled: nothing to swap
        assert model.norm.norm_fn is rms_norm
    model.compile_elementwise()
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    compiled = (compiled_op(rms_norm), compiled_op(apply_rope), compiled_op(silu_mul))
    assert (model.norm.norm_fn, attn.rope_fn, mlp.act_fn) == compiled
    with pytest.raises(RuntimeError, match="inside"):
        with model.eager_elementwise():
            assert (model.norm.norm_fn, attn.q_norm.norm_fn, attn.rope_fn, mlp.act_fn) == (
                rms_norm, rms_norm, apply_rope, silu_mul)
            raise RuntimeError("inside")
    assert (model.norm.norm_fn, attn.rope_fn, mlp.act_fn) == compiled and model.elementwise_compiled
