"""loss.py: the trainer's logprobs of sampled tokens, and the GRPO loss on stale samples.
  A_i   = r_i - mean(r of the group)
  rho_t = pi_theta(y_t) / pi_behav(y_t), pi_behav: the vLLM weights that sampled y_t (<= eta old)
  w_i   = the geometric mean of rho_t over completion i, 0 outside [low, high] = [1/8, 3]
  loss  = token mean over the batch of -A_i * sg(w_i) * log pi_theta(y_t)
One optimizer step a batch: a PPO clip never binds on fresh tokens; the bounds act on stale.
Runs in every trainer rank, on its share of each batch."""
import inspect, math
from functools import partial

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention.varlen import varlen_attn
from torch.utils.checkpoint import checkpoint
from transformers import AttentionInterface


def tokens(group):  # its length packed in a micro-batch
    return len(group["prompt_ids"]) + sum(len(c["ids"]) - 1 for c in group["completions"])


def micro_batches(groups, budget):  # consecutive groups, <= budget packed tokens (or one)
    batches = [[]]
    for g in groups:
        if batches[-1] and sum(map(tokens, batches[-1])) + tokens(g) > budget:
            batches.append([])
        batches[-1].append(g)
    return batches


def pack(groups):
    """A micro-batch as one padding-free sequence for varlen attention, and where each answer
    token is predicted. One group: prompt p0 p1 p2, answers a0 a1 a2 and b0 b1.

        ids   p0 p1 p2 a0 a1 b0    index 0..5; an answer's last token is a target only
        pos    0  1  2  3  4  3    RoPE: every answer continues its prompt
        segment   queries    keys (indices into ids)
          0       0 1 2      0 1 2          the prompt over itself, once for the group
          1       3 4        0 1 2 3 4      answer a over its prompt and itself
          2       5          0 1 2 5        answer b likewise
        src    2 3 4 | 2 5         a0 a1 a2 | b0 b1 are predicted by the logits at these

    A segment's queries are its last keys (causal, aligned bottom-right): cu_q, cu_k delimit
    them in ids and keys. `at` places the N answer tokens in the [C, T] rows, padded past each
    answer's end, of the sampler's logprobs (behav), versions and mask."""
    ids, pos, keys, src, sizes = [], [], [], [], []  # sizes: (queries, keys) a segment
    for g in groups:
        P = len(g["prompt_ids"])
        prompt = sum(map(len, ids)) + np.arange(P)
        ids.append(g["prompt_ids"])
        pos.append(np.arange(P))
        keys.append(prompt)
        sizes.append((P, P))
        for c in g["completions"]:
            n = len(c["ids"]) - 1
            own = sum(map(len, ids)) + np.arange(n)
            ids.append(c["ids"][:-1])
            pos.append(np.arange(P, P + n))
            src.append(np.concatenate([prompt[-1:], own]))
            if n:  # a one-token answer has no segment
                keys += [prompt, own]
                sizes.append((n, P + n))
    cu_q, cu_k = np.cumsum([(0, 0)] + sizes, axis=0).T
    comps = [c for g in groups for c in g["completions"]]
    C, T = len(comps), max(len(c["ids"]) for c in comps)
    joined = lambda parts: np.concatenate(parts).astype(np.int64)
    padded = lambda key, dtype: np.stack(
        [np.pad(np.asarray(c[key], dtype), (0, T - len(c[key]))) for c in comps])
    return dict(
        ids=joined(ids),  # [L] the packed sequence
        pos=joined(pos),  # [L] RoPE positions
        keys=joined(keys),  # [K]
        segments=np.c_[cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:]].tolist(),
        cu_q=cu_q.astype(np.int32), cu_k=cu_k.astype(np.int32),  # [S + 1]
        max_q=int(np.diff(cu_q).max()), max_k=int(np.diff(cu_k).max()),  # a segment's longest
        src=joined(src),  # [N] the completions' tokens
        targets=joined([c["ids"] for c in comps]),  # [N]
        at=joined([c * T + np.arange(len(comps[c]["ids"])) for c in range(C)]),  # in C x T
        behav=padded("logprobs", np.float32),  # [C, T] vLLM's, 0 past the end
        versions=padded("versions", np.int64),  # [C, T] the version that sampled each
        mask=padded("mask", np.float32),  # [C, T] 1: the model's token, not a tool's
        rewards=np.array([c["reward"] for c in comps], np.float32),  # [C]
        C=C, T=T)


def to_device(batch, device):  # to a GPU not blocking (it waits for work)
    def move(x):
        t = torch.from_numpy(x)
        return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t
    return {k: move(x) if isinstance(x, np.ndarray) else x for k, x in batch.items()}


VARLEN = True  # FlashAttention's varlen kernel where it runs
# grouped-query heads (torch 2.11's varlen_attn has no enable_gqa): asked once, not traced in
# every layer
GQA = {"enable_gqa": True} if "enable_gqa" in inspect.signature(varlen_attn).parameters else {}


def varlen_runs(device, dtype):  # else a Python loop of SDPA calls, compiled per shape
    return VARLEN and device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)


def packed_attention(module, q, k, v, mask, scaling, packed=None, **unused):
    """HF's attention over pack(): q [1, H, L, D], k, v [1, Hkv, L, D] -> [1, L, H, D], causal,
    bottom-right (a segment's queries are its last keys)."""
    q, k, v = (x[0].transpose(0, 1) for x in (q, k, v))  # [L, heads, D]
    k, v = k[packed["keys"]], v[packed["keys"]]  # [K, Hkv, D]
    if varlen_runs(q.device, q.dtype):  # FlashAttention-2, grouped-query heads
        return varlen_attn(q, k, v, packed["cu_q"], packed["cu_k"], packed["max_q"],
                           packed["max_k"], scale=scaling, window_size=(-1, 0), **GQA)[None], None
    out = torch.empty_like(q)  # else an SDPA call a segment
    for q0, q1, k0, k1 in packed["segments"]:
        causal = q.new_ones(q1 - q0, k1 - k0, dtype=torch.bool)
        seg = [x.transpose(0, 1) for x in (q[q0:q1], k[k0:k1], v[k0:k1])]  # [heads, n, D]
        out[q0:q1] = F.scaled_dot_product_attention(
            *seg, attn_mask=causal.tril(k1 - k0 - (q1 - q0)), scale=scaling,
            enable_gqa=True).transpose(0, 1)
    return out[None], None


AttentionInterface.register("nanoasync_packed", packed_attention)


def mm32(a, b):  # a @ b, fp32 sums and result (bf16: on tensor cores)
    if a.is_cuda and a.dtype != torch.float32:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


class SampledLogprob(torch.autograd.Function):
    """log_softmax(h @ w.T / T)[ids] in fp32 as vLLM, `rows` at a time; kept or recomputed."""

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
        grad_h, grad_w = torch.empty_like(h), None
        for k, i in enumerate(range(0, len(h), ctx.rows)):
            x, y = h[i:i + ctx.rows], ids[i:i + ctx.rows]
            p = ctx.probs[k]  # overwritten: not needed after
            if p is None:
                p = (mm32(x, w.t()) / ctx.temperature).softmax(-1)
            g = p.neg_()
            g[torch.arange(len(y), device=g.device), y] += 1
            g = g.mul_(grad[i:i + ctx.rows, None] / ctx.temperature).to(h.dtype)
            grad_h[i:i + ctx.rows] = g @ w
            if ctx.needs_input_grad[1]:  # not when frozen (LoRA)
                part = mm32(g.t(), x)  # fp32 sums
                grad_w = part if grad_w is None else grad_w.add_(part)
        return grad_h, None if grad_w is None else grad_w.to(w.dtype), None, None, None, None


def token_logprobs(net, batch, temperature, rows=1024, keep_mb=2048):
    """One forward of pack() -> logp [C, T]; the head gives the sampled tokens' logprobs
    [N], not [L, V] logits (called after the body, it would miss FSDP's hooks)."""
    head = net.get_output_embeddings()
    packed = {k: batch[k] for k in ("keys", "segments", "cu_q", "cu_k", "max_q", "max_k")}

    def sampled(h):  # [1, L, hidden] -> [N]
        x = h[0, batch["src"]]
        keep = len(x) * head.weight.shape[0] * 4 <= keep_mb * 2**20  # fp32 logits
        return SampledLogprob.apply(x, head.weight, batch["targets"], temperature, rows, keep)
    head.forward = sampled
    try:
        lp = net(input_ids=batch["ids"][None], position_ids=batch["pos"][None], use_cache=False,
                 packed=packed).logits
    finally:
        del head.forward
    logp = lp.new_zeros(batch["C"] * batch["T"])
    return logp.index_put((batch["at"],), lp).view(batch["C"], batch["T"])


def group_advantages(rewards, group_size):  # not divided by the std (results log)
    r = rewards.view(-1, group_size)
    return (r - r.mean(1, keepdim=True)).reshape(-1)


def grpo_loss(logp, behav, adv, mask, n_tokens, low=0.125, high=3.0):
    """logp, behav, mask [B, T]; adv [B]; n_tokens: the batch's (micro-batches and ranks sum to its
    token mean) -> (loss, tokens bounded)"""
    # a ratio a completion, its tokens' geometric mean (per token: worse)
    n = mask.sum(1, keepdim=True).clamp(min=1)
    log_rho = ((logp.detach() - behav) * mask).sum(1, keepdim=True) / n
    bounded = ((log_rho > math.log(high)) | (log_rho < math.log(low))) & (mask > 0)
    w = log_rho.exp() * ~bounded
    # exp(logp - sg(logp)) = 1, with logp's gradient: -A w dlogp
    per_tok = -adv[:, None] * w * (logp - logp.detach()).exp()
    return (per_tok * mask).sum() / n_tokens, bounded


def wrap_layers(net, compiled, checkpointing):
    """Compile each layer's body (elementwise work: a third of a GPU step at 1.5B), then maybe
    checkpoint it (compiled around a checkpoint, nothing is)."""
    for layer in net.model.layers:
        if compiled:
            layer.forward = torch.compile(layer.forward)
        if checkpointing:
            layer.forward = partial(checkpoint, layer.forward, use_reentrant=False)


def shard(net, dtype, checkpointing=False, compiled=False):
    """FSDP2 on each layer and the root, `dtype` compute. Weights stay gathered through a step
    (train.py): no collective between micro-batches, 6 B a parameter.

    A frozen base (LoRA) stays out of FSDP: each rank holds it whole, once, in `dtype`. Managed,
    it would be gathered into a second copy kept all step (even at one rank FSDP2 allocates the
    unsharded copy apart): a 7B base 2 x 14.2 GiB instead of 14.2."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    net.set_attn_implementation("nanoasync_packed")
    wrap_layers(net, compiled and varlen_runs(next(net.parameters()).device, dtype), checkpointing)
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    frozen = {p for p in net.parameters() if not p.requires_grad} or None
    for module in [*net.model.layers, net]:  # each layer, then the root
        fully_shard(module, mp_policy=mp, reshard_after_forward=False, ignored_params=frozen)
