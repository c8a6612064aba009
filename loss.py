"""
loss.py: GRPO on stale samples (truncated importance weights), as pure tensor functions.

For a batch of groups (group_size completions of one prompt each):
  advantage  A_i   = r_i - mean(group)            (optionally / (std(group) + eps))
  ratio      rho_t = pi_theta(y_t) / pi_behav(y_t)  pi_behav = the logprobs vLLM returned for the token it sampled,
                                                   i.e. the (possibly several versions old) policy that generated it
  weight     w_t   = min(rho_t, tis_cap), held constant        truncated importance weight: the sample came from
                                                               pi_behav, the gradient is wanted for pi_theta
  surrogate  -A_i w_t pi_theta(y_t) / sg(pi_theta(y_t))       value -A w, gradient -A w grad log pi_theta
  loss       sum over every completion token in the batch / number of those tokens   (token-level normalisation)

Why no PPO clip. A clip of pi_theta / pi_old bounds how far several updates on one batch drift from the policy that
began them (AReaL's "decoupled" loss clips against that proximal policy and weights by pi_old / pi_behav). Here each
batch gets one optimizer step, so pi_old = pi_theta when the gradient is taken and that clip never binds. Clipping
against pi_behav instead (asymmetric, 0.8..1.28) is not a trust region but a penalty on staleness: the tokens it
silences are the ones the previous step already moved most, which on the arithmetic task are the few tokens that
decide the answer; measured, async then fell behind sync by more than its staleness (docs/LOG.md, "Off-policy
correction").

token_logprobs() scores the sampled tokens under the trainer's model the way the sampler drew them:
log_softmax(logits / T), the same distribution vLLM reports with logprobs_mode="processed_logprobs". Its output
layer computes the logits of a chunk of positions at a time and keeps only the sampled tokens' logprobs
(SampledLogprob), so the [positions x vocabulary] logits never exist whole, in forward or backward.

Simplifications: one optimizer step per batch (so no separate "old policy" pass and no clip); the optional KL to a
reference policy uses the k3 estimator per token.
"""
from contextlib import contextmanager

import torch
from transformers import DynamicCache


class SampledLogprob(torch.autograd.Function):
    """log_softmax(h @ w.T / T) at the sampled ids, `rows` positions at a time: the [positions x vocabulary]
    logits exist for one chunk at once, in fp32. Backward recomputes each chunk's softmax, unless all of them
    together fit in keep_mb (a small vocabulary or a short micro-batch): then forward keeps them.
    h [N, H], w [V, H], ids [N, K] (K targets per position) -> [N, K] fp32."""

    @staticmethod
    def forward(ctx, h, w, ids, temperature, rows, keep_mb):
        out, kept = [], []
        keep = h.shape[0] * w.shape[0] * 4 <= keep_mb * 2**20
        for i in range(0, h.shape[0], rows):
            z = (h[i:i + rows] @ w.t()).float() / temperature
            lse = z.logsumexp(1, keepdim=True)
            out.append(z.gather(1, ids[i:i + rows]) - lse)
            if keep:
                kept.append(z.sub_(lse).exp_())  # the softmax, in place of the logits
        ctx.save_for_backward(h, w, ids)
        ctx.temperature, ctx.rows, ctx.kept = temperature, rows, kept
        return torch.cat(out)

    @staticmethod
    def backward(ctx, g):
        h, w, ids = ctx.saved_tensors
        T, rows = ctx.temperature, ctx.rows
        dh, dw = torch.empty_like(h), torch.zeros(w.shape, dtype=torch.float32, device=w.device)
        for c, i in enumerate(range(0, h.shape[0], rows)):
            hc, gc = h[i:i + rows], g[i:i + rows]
            p = ctx.kept[c] if ctx.kept else torch.softmax((hc @ w.t()).float() / T, 1)
            dz = p * -gc.sum(1, keepdim=True)  # d/dz of z[y] - logsumexp(z) = onehot(y) - softmax(z)
            dz = (dz.scatter_add_(1, ids[i:i + rows], gc) / T).to(h.dtype)
            dh[i:i + rows] = dz @ w
            dw += (dz.t() @ hc).float()
        ctx.kept = None
        return dh, dw.to(w.dtype), None, None, None, None


@contextmanager
def scoring(net, ids, temperature, rows=1024, keep_mb=512):
    """The output layer returns the logprobs of `ids` [B, T, K] instead of logits [B, T, V] for one forward
    call (swapping its forward keeps FSDP's hooks, which sit on the root module, untouched)."""
    head = net.get_output_embeddings()
    # (a copy, not a view: FSDP hooks its backward onto the output, which a view may lose)
    head.forward = lambda h: SampledLogprob.apply(h.reshape(-1, h.shape[-1]), head.weight,
                                                  ids.reshape(-1, ids.shape[-1]), temperature, rows,
                                                  keep_mb).view(*h.shape[:-1], ids.shape[-1]).clone()
    try:
        yield
    finally:
        del head.forward


def plan_chunks(lengths, max_pad=1.1, n_chunks=0):
    """Rows (completion indices) in chunks of similar length, longest first, a chunk's padded area at most max_pad
    times its real tokens. n_chunks: split further (the chunk with the largest padded area first) until there are
    exactly that many, so that every FSDP rank runs the same forward calls; a rank short of rows repeats its
    shortest one, marked None, for a chunk whose result is multiplied by 0."""
    chunks, real = [], 0
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if chunks and (len(chunks[-1]) + 1) * lengths[chunks[-1][0]] <= max_pad * (real + lengths[i]):
            chunks[-1].append(i)
            real += lengths[i]
        else:
            chunks.append([i])
            real = lengths[i]
    while len(chunks) < n_chunks:
        big = max(range(len(chunks)), key=lambda c: len(chunks[c]) * lengths[chunks[c][0] or 0])
        if len(chunks[big]) > 1:
            half = len(chunks[big]) // 2
            chunks[big:big + 1] = [chunks[big][:half], chunks[big][half:]]
        else:
            chunks.append([None])
    return chunks


def token_logprobs(net, groups, temperature, device, max_pad=1.1, n_chunks=0):
    """Logprobs of every completion token of these groups under net, at the sampling temperature
    -> (logp, mask, (computed, real)), logp and mask [completions, longest completion], rows in group order.
    Each prompt runs once and its KV cache is shared by the group's completions (for short answers that halves
    the tokens). Completions then run in chunks of similar length (plan_chunks): one rambling answer would otherwise
    pad every row to its length. The output layer scores only the sampled tokens (SampledLogprob). computed, real:
    the positions the forward passes computed, and those that were not padding. Prompts are left-padded,
    completions right-padded."""
    n = len(groups[0]["completions"])
    prompts = [g["prompt_ids"] for g in groups]
    comps = [c["ids"] for g in groups for c in g["completions"]]
    P, T = max(map(len, prompts)), max(max(map(len, comps)), 2)
    pids, cids = torch.zeros(len(prompts), P, dtype=torch.long), torch.zeros(len(comps), T, dtype=torch.long)
    pmask, cmask = torch.zeros_like(pids), torch.zeros_like(cids)
    for i, p in enumerate(prompts):
        pids[i, P - len(p):], pmask[i, P - len(p):] = torch.tensor(p), 1
    for i, c in enumerate(comps):
        cids[i, :len(c)], cmask[i, :len(c)] = torch.tensor(c), 1
    pids, pmask, cids, cmask = pids.to(device), pmask.to(device), cids.to(device), cmask.to(device)
    with scoring(net, cids[:, :1].reshape(len(prompts), 1, n), temperature):  # each prompt's last position
        out = net(input_ids=pids, attention_mask=pmask, position_ids=(pmask.cumsum(1) - 1).clamp(min=0),
                  use_cache=True, logits_to_keep=1)                          # scores every first token
    first = out.logits.reshape(len(comps), 1)
    logp, computed, real = torch.zeros(len(comps), T, device=device), pids.numel(), int(pmask.sum())
    for rows in plan_chunks([len(c) for c in comps], max_pad, n_chunks):
        dummy = rows == [None]
        rows = [min(range(len(comps)), key=lambda i: len(comps[i]))] if dummy else rows
        idx = torch.tensor(rows, device=device)
        # with n_chunks (several FSDP ranks) every chunk runs a forward, even of one-token answers
        lp, Tc = first[idx], max(len(comps[rows[0]]), 2 if n_chunks else 1)
        if Tc > 1:  # a fresh cache holding these rows' prompts; the forward appends the completion to it
            cache = DynamicCache()
            for layer, kv in enumerate(out.past_key_values.layers):
                cache.update(kv.keys[idx // n], kv.values[idx // n], layer)
            pm, cm = pmask[idx // n], cmask[idx, :Tc - 1]
            with scoring(net, cids[idx, 1:Tc, None], temperature):
                rest = net(input_ids=cids[idx, :Tc - 1], attention_mask=torch.cat([pm, cm], 1),
                           position_ids=pm.sum(1, keepdim=True) + torch.arange(Tc - 1, device=device),
                           past_key_values=cache).logits[..., 0]
            lp = torch.cat([lp, rest], 1)
            computed, real = computed + cm.numel(), real + (0 if dummy else int(cm.sum()))
        if dummy:  # keeps this rank's FSDP collectives in step with the others; adds nothing
            logp = logp + 0 * lp.sum()
        else:
            logp = logp.index_put((idx,), torch.nn.functional.pad(lp, (0, T - Tc)))
    return logp * cmask, cmask, (computed, real)


def group_advantages(rewards, group_size, norm_std=False, eps=1e-6):
    """rewards: [num_groups * group_size] -> advantages of the same shape."""
    r = rewards.view(-1, group_size)
    adv = r - r.mean(dim=1, keepdim=True)
    if norm_std:
        adv = adv / (r.std(dim=1, keepdim=True) + eps)
    return adv.reshape(-1)


def grpo_loss(logp, behav_logp, adv, mask, n_tokens, tis_cap=3.0, ref_logp=None, kl_coef=0.0):
    """
    logp, behav_logp, mask: [B, T] (mask is 1 on completion tokens); adv: [B]; n_tokens: the number of completion
    tokens in the whole batch (all micro-batches, all ranks), so micro-batches and ranks add up to a token mean.
    Returns (loss, truncated): truncated marks the completion tokens whose importance weight hit tis_cap.
    """
    mask = mask.to(logp.dtype)
    ratio = torch.exp(logp.detach() - behav_logp)
    w = ratio.clamp(max=tis_cap)
    per_tok = -adv.unsqueeze(1) * w * torch.exp(logp - logp.detach())
    if kl_coef > 0:  # k3 estimator of KL(pi_theta || pi_ref), unbiased and >= 0
        d = ref_logp - logp
        per_tok = per_tok + kl_coef * (torch.exp(d) - d - 1)
    loss = (per_tok * mask).sum() / n_tokens
    return loss, (ratio > tis_cap) & (mask > 0)
