"""loss.py: the trainer's logprobs of the sampled tokens, and the GRPO loss on stale samples.

  A_i   = r_i - mean(r of the group)
  rho_t = pi_theta(y_t) / pi_behav(y_t), pi_behav: the vLLM weights that sampled y_t (<= eta old)
  w_i   = the geometric mean of rho_t over completion i, 0 outside [low, high] = [1/8, 3]
  loss  = token mean over the batch of -A_i * sg(w_i) * log pi_theta(y_t)

One optimizer step a batch, so a PPO clip would never bind on fresh tokens; the bounds act on
stale ones. A micro-batch is one packed sequence with no padding: each group's prompt once, then
each of its completions, and an attention that lets a completion see only its prompt and itself.
"""
import inspect
import math
from contextlib import contextmanager
from functools import partial

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from transformers import AttentionInterface


def tokens(group):  # the positions a group takes in a packed micro-batch
    comps = group["completions"]
    return len(group["prompt_ids"]) + sum(len(c["ids"]) - 1 for c in comps)


def micro_batches(groups, budget):
    """Consecutive groups, at most `budget` packed tokens each (a larger group alone)."""
    batches, size = [[]], 0
    for g in groups:
        if batches[-1] and size + tokens(g) > budget:
            batches.append([])
            size = 0
        batches[-1].append(g)
        size += tokens(g)
    return batches


def pack(groups):
    """One micro-batch as one sequence, on the host (numpy), for token_logprobs().

    A completion's last token is predicted, never read: only its others are inputs. Attention
    runs segment by segment: a prompt over itself, then each completion over its prompt and
    itself. `keys` lists, segment after segment, the positions each one attends to; `cu_q` and
    `cu_k` are where the segments start among the queries and among the keys (as FlashAttention's
    varlen kernels take them). Completion token t is predicted at position `src`: the prompt's
    last for t = 0, else the completion's own t - 1. C completions, T the longest."""
    ids, pos, keys, src, segments = [], [], [], [], []
    start = n_keys = 0
    for g in groups:
        P = len(g["prompt_ids"])
        prompt = np.arange(start, start + P)
        ids.append(g["prompt_ids"])
        pos.append(np.arange(P))
        keys.append(prompt)
        segments.append((start, start + P, n_keys, n_keys + P))
        start += P
        n_keys += P
        for c in g["completions"]:
            n = len(c["ids"]) - 1
            own = np.arange(start, start + n)
            ids.append(c["ids"][:-1])
            pos.append(np.arange(P, P + n))
            src.append(np.concatenate([prompt[-1:], own]))
            if n:  # a one-token answer reads nothing: it makes no segment
                keys += [prompt, own]
                segments.append((start, start + n, n_keys, n_keys + P + n))
            start += n
            n_keys += P + n if n else 0
    comps = [c for g in groups for c in g["completions"]]
    C, T = len(comps), max(len(c["ids"]) for c in comps)
    padded = lambda key, dtype: np.stack([np.pad(np.asarray(c[key], dtype), (0, T - len(c[key])))
                                          for c in comps])
    lengths = np.array([len(c["ids"]) for c in comps])
    return dict(
        ids=np.concatenate(ids).astype(np.int64),  # [L] the packed sequence
        pos=np.concatenate(pos).astype(np.int64),  # [L] its positions for RoPE
        keys=np.concatenate(keys).astype(np.int64),  # [K]
        segments=segments,  # [(first query, end, first key, end)], a tuple a segment
        cu_q=np.array([s[0] for s in segments] + [start], np.int32),  # [S + 1]
        cu_k=np.array([s[2] for s in segments] + [n_keys], np.int32),
        src=np.concatenate(src).astype(np.int64),  # [N] every completion token's predictor
        targets=np.concatenate([c["ids"] for c in comps]).astype(np.int64),  # [N]
        # where each of the N lands in [C, T]: row c, column t, as c * T + t
        at=np.concatenate([c * T + np.arange(n) for c, n in enumerate(lengths)]),
        behav=padded("logprobs", np.float32),  # [C, T] vLLM's logprobs, 0 past the end
        versions=padded("versions", np.int64),  # [C, T] the version that sampled each token
        mask=padded("mask", np.float32),  # [C, T] 1: the model's token; 0: a tool's, or past the end
        rewards=np.array([c["reward"] for c in comps], np.float32),  # [C]
        C=C, T=T)


def to_device(batch, device):
    """Every array to `device`. On a GPU from pinned memory, without blocking: a blocking copy
    would make the host wait for the micro-batch before (the device's queue would run dry)."""
    out = dict(batch)
    for k, x in batch.items():
        if isinstance(x, np.ndarray):
            t = torch.from_numpy(x)
            out[k] = t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t
    return out


VARLEN = True  # FlashAttention's varlen kernel where it runs (bench.py --trainer compares)


def packed_attention(module, q, k, v, mask, scaling, packed=None, **unused):
    """HF's attention interface, over a packed micro-batch (pack()): q [1, H, L, D], k and v
    [1, Hkv, L, D] -> [1, L, H, D]. Causal within a segment, its queries aligned to the end of
    its keys (a completion's first query sees the whole prompt). HF builds no mask for it."""
    q, k, v = (x[0].transpose(0, 1) for x in (q, k, v))  # [L, heads, D]
    k, v = k[packed["keys"]], v[packed["keys"]]  # [K, Hkv, D]: each segment's keys in a row
    if VARLEN and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16):  # FlashAttention
        return varlen(q, k, v, packed, scaling)[None], None
    out = torch.empty_like(q)  # CPU (and fp32): the same segments, an SDPA call each
    for q0, q1, k0, k1 in packed["segments"]:
        causal = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool, device=q.device)
        seg = [x.transpose(0, 1) for x in (q[q0:q1], k[k0:k1], v[k0:k1])]  # [heads, n, D]
        out[q0:q1] = F.scaled_dot_product_attention(
            *seg, attn_mask=causal.tril(k1 - k0 - (q1 - q0)), scale=scaling,
            enable_gqa=True).transpose(0, 1)
    return out[None], None


def varlen(q, k, v, packed, scaling):
    """torch's FlashAttention-2 varlen kernel. Its causal mask is aligned bottom-right (query i
    of a segment sees keys up to i + its keys - its queries), and it serves grouped-query heads
    itself (query head h reads KV head h // (H / Hkv), as HF's repeat_kv). torch 2.13 asks for
    enable_gqa=True; 2.11 has no such flag and no check."""
    from torch.nn.attention.varlen import varlen_attn
    gqa = "enable_gqa" in inspect.signature(varlen_attn).parameters
    max_q = max(q1 - q0 for q0, q1, _, _ in packed["segments"])
    max_k = max(k1 - k0 for _, _, k0, k1 in packed["segments"])
    return varlen_attn(q, k, v, packed["cu_q"], packed["cu_k"], max_q, max_k, scale=scaling,
                       window_size=(-1, 0), **({"enable_gqa": True} if gqa else {}))


AttentionInterface.register("nanoasync_packed", packed_attention)


def mm32(a, b):  # a @ b with fp32 sums and result; on a GPU from bf16 at tensor-core speed
    if a.is_cuda and a.dtype != torch.float32:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


class SampledLogprob(torch.autograd.Function):
    """log_softmax(h @ w.T / T)[ids] with fp32 logits, `rows` positions at a time. bf16 logits
    would round each to 3 digits, where vLLM's differ (its output layer runs in fp32 too); and
    fp32 weights on a GPU would take the slow fp32 path. Past keep_mb of logits the backward
    pass computes them again instead of keeping them."""

    @staticmethod
    def forward(ctx, h, w, ids, temperature, rows, keep):
        logps, probs = [], []
        for i in range(0, len(h), rows):
            lp = (mm32(h[i:i + rows], w.t()) / temperature).log_softmax(-1)
            logps.append(lp.gather(-1, ids[i:i + rows, None])[:, 0])
            probs.append(lp.exp_() if keep else None)
        ctx.save_for_backward(h, w, ids)
        ctx.probs, ctx.temperature, ctx.rows = probs, temperature, rows
        return torch.cat(logps)

    @staticmethod
    def backward(ctx, grad):  # d logp(y) / d logits = (onehot(y) - softmax) / T
        h, w, ids = ctx.saved_tensors
        grad_h, grad_w = torch.empty_like(h), torch.zeros(w.shape, device=w.device)
        for k, i in enumerate(range(0, len(h), ctx.rows)):
            x, y = h[i:i + ctx.rows], ids[i:i + ctx.rows]
            p = ctx.probs[k]
            if p is None:
                p = (mm32(x, w.t()) / ctx.temperature).softmax(-1)
            g = -p
            g[torch.arange(len(y), device=g.device), y] += 1
            g = (g * (grad[i:i + ctx.rows, None] / ctx.temperature)).to(h.dtype)
            grad_h[i:i + ctx.rows] = g @ w
            grad_w += mm32(g.t(), x)
        return grad_h, grad_w.to(w.dtype), None, None, None, None


@contextmanager
def scoring(net, src, targets, temperature, rows=1024, keep_mb=2048):
    """For one forward call the output layer returns the logprobs of `targets` [N] at the
    positions `src` [N], not [L, V] logits (SampledLogprob). A patched forward, not a call of
    the body and then the head: FSDP's hooks on the root must gather the head's weights."""
    head = net.get_output_embeddings()

    def forward(h):  # [1, L, hidden] -> [N]
        x = h[0, src]
        keep = len(x) * head.weight.shape[0] * 4 <= keep_mb * 2**20
        return SampledLogprob.apply(x, head.weight, targets, temperature, rows, keep)
    head.forward = forward
    try:
        yield
    finally:
        del head.forward


def token_logprobs(net, batch, temperature):
    """One forward of a packed micro-batch (pack(), on the device) -> logp [C, T]: each
    completion's tokens' logprobs under the policy at `temperature`, 0 past its end."""
    packed = {k: batch[k] for k in ("keys", "segments", "cu_q", "cu_k")}  # for the attention
    with scoring(net, batch["src"], batch["targets"], temperature):
        lp = net(input_ids=batch["ids"][None], position_ids=batch["pos"][None], use_cache=False,
                 packed=packed).logits  # [N]
    logp = torch.zeros(batch["C"] * batch["T"], device=lp.device, dtype=lp.dtype)
    return logp.index_put((batch["at"],), lp).view(batch["C"], batch["T"])


def group_advantages(rewards, group_size):  # no division by the std (the results log)
    r = rewards.view(-1, group_size)
    return (r - r.mean(dim=1, keepdim=True)).reshape(-1)


def grpo_loss(logp, behav, adv, mask, n_tokens, low=0.125, high=3.0):
    """logp, behav, mask [B, T]; adv [B]; n_tokens: the batch's (micro-batches and ranks add up to
    its token mean). -> (loss, tokens whose weight was bounded)"""
    mask = mask.to(logp.dtype)
    # one ratio per completion: its tokens' geometric mean (ahead of per-token ratios on average)
    n = mask.sum(1, keepdim=True).clamp(min=1)
    log_rho = ((logp.detach() - behav) * mask).sum(1, keepdim=True) / n
    bounded = ((log_rho > math.log(high)) | (log_rho < math.log(low))) & (mask > 0)
    w = torch.exp(log_rho) * ~bounded
    # exp(logp - sg(logp)) is 1 with logp's gradient: the value is -A w, the gradient -A w dlogp
    per_tok = -adv.unsqueeze(1) * w * torch.exp(logp - logp.detach())
    return (per_tok * mask).sum() / n_tokens, bounded


def checkpoint_layers(net):
    """Activation checkpointing: each decoder layer keeps only its input, and runs again in the
    backward pass."""
    for layer in net.model.layers:
        layer.forward = partial(checkpoint, layer.forward, use_reentrant=False)


def shard(net, dtype, checkpointing=False):
    """FSDP2: each decoder layer, then the root; fp32 master weights and gradient reduction,
    `dtype` compute, and the packed attention. Weights stay gathered from a step's first forward
    to its last backward (train.py: set_reshard_after_backward), not gathered again for each
    micro-batch: 2 bytes a parameter more on each rank, and no collective between micro-batches."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    net.set_attn_implementation("nanoasync_packed")
    if checkpointing:
        checkpoint_layers(net)
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for layer in net.model.layers:
        fully_shard(layer, mp_policy=mp, reshard_after_forward=False)
    return fully_shard(net, mp_policy=mp, reshard_after_forward=False)
