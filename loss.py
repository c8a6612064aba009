"""loss.py: the trainer's logprobs of the sampled tokens and the GRPO loss on stale samples:
  A_i   = r_i - mean(r of the group)
  rho_t = pi_theta(y_t) / pi_behav(y_t), pi_behav: the vLLM weights that sampled y_t (<= eta old)
  w_i   = the geometric mean of rho_t over completion i, 0 outside [low, high] = [1/8, 3]
  loss  = token mean over the batch of -A_i * sg(w_i) * log pi_theta(y_t)
One optimizer step a batch: a PPO clip would never bind on fresh tokens; the bounds act on stale."""
import math
from contextlib import contextmanager

import torch
from torch.utils.checkpoint import checkpoint
from transformers import DynamicCache


def sampled_logprob(h, w, ids, temperature):  # log_softmax(h @ w.T / T)[ids], in fp32
    return ((h @ w.t()).float() / temperature).log_softmax(1).gather(1, ids)


@contextmanager
def scoring(net, ids, temperature, rows=1024, keep_mb=512):
    """For one forward call the output layer returns the logprobs of `ids` [B, T, K], not logits,
    past keep_mb in chunks of `rows` recomputed in backward (FSDP's hooks sit on the root)."""
    head = net.get_output_embeddings()

    def forward(h):
        x, y = h.reshape(-1, h.shape[-1]), ids.reshape(-1, ids.shape[-1])
        if x.shape[0] * head.weight.shape[0] * 4 <= keep_mb * 2**20:
            lp = sampled_logprob(x, head.weight, y, temperature)
        else:
            lp = torch.cat([checkpoint(sampled_logprob, x[i:i + rows], head.weight, y[i:i + rows],
                                       temperature, use_reentrant=False)
                            for i in range(0, x.shape[0], rows)])
        return lp.view(*h.shape[:-1], ids.shape[-1]).clone()  # the clone: for FSDP's backward
    head.forward = forward
    try:
        yield
    finally:
        del head.forward


def checkpoint_layers(net):
    """Whole-layer activation checkpointing; a recompute first cuts the shared KV cache back."""
    for layer in net.model.layers:
        def forward(*args, _inner=layer.forward, _i=layer.self_attn.layer_idx, **kw):
            layers = getattr(kw.get("past_key_values"), "layers", [])
            kv = layers[_i] if len(layers) > _i else None
            n = kv.keys.shape[-2] if kv is not None and kv.is_initialized else 0

            def run(*a, **k):
                if kv is not None and kv.is_initialized:
                    kv.keys, kv.values = kv.keys[..., :n, :], kv.values[..., :n, :]
                return _inner(*a, **k)
            return checkpoint(run, *args, use_reentrant=False, **kw)
        layer.forward = forward


def plan_chunks(lengths, max_pad=1.1, n_chunks=0):
    """Rows in chunks of similar length, longest first, each at most max_pad x its real tokens.
    n_chunks: split the largest until there are that many; short of rows, add [None] (a dummy)."""
    chunks, real = [], 0
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        real += lengths[i]
        if chunks and (len(chunks[-1]) + 1) * lengths[chunks[-1][0]] <= max_pad * real:
            chunks[-1].append(i)
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


def padded(rows, device, left=False, width=1, dtype=torch.long):  # -> rows, mask [len, longest]
    ids = torch.zeros(len(rows), max(width, *map(len, rows)), dtype=dtype)
    mask = torch.zeros_like(ids, dtype=torch.long)
    for i, r in enumerate(rows):  # a list, or an engine's array (rollout.TOKENS)
        span = slice(ids.shape[1] - len(r), None) if left else slice(0, len(r))
        ids[i, span], mask[i, span] = torch.as_tensor(r), 1
    return ids.to(device), mask.to(device)


def token_logprobs(net, groups, temperature, device, max_pad=1.1, n_chunks=0):
    """-> logp, mask [completions, longest] (the model's tokens: a tool's are context), (positions
    computed, real). Each prompt runs once; its KV cache serves its completions, in chunks."""
    n, comps = len(groups[0]["completions"]), [c["ids"] for g in groups for c in g["completions"]]
    pids, pmask = padded([g["prompt_ids"] for g in groups], device, left=True)
    cids, cmask = padded(comps, device, width=2)  # 2: see Tc below
    with scoring(net, cids[:, :1].reshape(len(groups), 1, n), temperature):  # every first token
        out = net(input_ids=pids, attention_mask=pmask, use_cache=True, logits_to_keep=1,
                  position_ids=(pmask.cumsum(1) - 1).clamp(min=0))
    first = out.logits.reshape(len(comps), 1)
    logp, computed, real = torch.zeros(cids.shape, device=device), pids.numel(), int(pmask.sum())
    for rows in plan_chunks([len(c) for c in comps], max_pad, n_chunks):
        dummy = rows == [None]
        rows = [min(range(len(comps)), key=lambda i: len(comps[i]))] if dummy else rows
        idx = torch.tensor(rows, device=device)
        # with n_chunks, every chunk runs a forward: FSDP ranks must make as many calls
        lp, Tc = first[idx], max(len(comps[rows[0]]), 2 if n_chunks else 1)
        if Tc > 1:  # a fresh cache holding these rows' prompts, to which the completions append
            cache = DynamicCache()
            for layer, kv in enumerate(out.past_key_values.layers):
                cache.update(kv.keys[idx // n], kv.values[idx // n], layer)
            pm, cm = pmask[idx // n], cmask[idx, :Tc - 1]
            pos = pm.sum(1, keepdim=True) + torch.arange(Tc - 1, device=device)
            with scoring(net, cids[idx, 1:Tc, None], temperature):
                rest = net(input_ids=cids[idx, :Tc - 1], attention_mask=torch.cat([pm, cm], 1),
                           position_ids=pos, past_key_values=cache).logits[..., 0]
            lp = torch.cat([lp, rest], 1)
            computed, real = computed + cm.numel(), real + (0 if dummy else int(cm.sum()))
        if dummy:
            logp = logp + 0 * lp.sum()
        else:
            logp = logp.index_put((idx,), torch.nn.functional.pad(lp, (0, cids.shape[1] - Tc)))
    model = padded([c["mask"] for g in groups for c in g["completions"]], device, width=2)[0]
    return logp * cmask, cmask * model, (computed, real)


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
    per_tok = -adv.unsqueeze(1) * w * torch.exp(logp - logp.detach())  # value -A w, grad -A w dlogp
    return (per_tok * mask).sum() / n_tokens, bounded


def shard(net, dtype, checkpointing=False):  # FSDP2: each layer, then the root; fp32 weights, grads
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    if checkpointing:
        checkpoint_layers(net)
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for layer in net.model.layers:
        fully_shard(layer, mp_policy=mp)
    return fully_shard(net, mp_policy=mp)


def agreed_chunks(groups, world, device):  # FSDP needs equal forward counts, not shapes: the most
    if world == 1:
        return 0
    lengths = [len(c["ids"]) for g in groups for c in g["completions"]]
    n = torch.tensor([len(plan_chunks(lengths))], device=device)
    torch.distributed.all_reduce(n, op=torch.distributed.ReduceOp.MAX)
    return int(n)
