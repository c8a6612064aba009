"""
loss.py: staleness-clipped GRPO, as pure tensor functions.

For a batch of groups (group_size completions of one prompt each):
  advantage  A_i   = r_i - mean(group)            (optionally / (std(group) + eps))
  ratio      rho_t = pi_theta(y_t) / pi_behav(y_t)  pi_behav = the logprobs vLLM returned for the token it sampled,
                                                   i.e. the (possibly several versions old) policy that generated it
  surrogate  max(-A rho, -A clip(rho, 1 - eps_low, 1 + eps_high))           (PPO, asymmetric "clip-higher")
  truncation for A < 0 the surrogate is capped at -A * tis_cap             (dual clip: no unbounded weight on
                                                                           tokens the behaviour policy found unlikely)
  loss       sum over every completion token in the batch / number of those tokens   (token-level normalisation)

Because the ratio is taken against the behaviour policy, not against the trainer's weights at the start of the step,
the clip is a trust region around the data: the staler a sample, the further pi_theta has moved from it and the more
of its tokens fall outside the clip and stop contributing gradient. That is the whole off-policy correction.

token_logprobs() scores the sampled tokens under the trainer's model the way the sampler drew them:
log_softmax(logits / T), the same distribution vLLM reports with logprobs_mode="processed_logprobs".

Simplifications: one optimizer step per batch (so no separate "old policy" pass); the optional KL to a reference
policy uses the k3 estimator per token.
"""
import torch
from transformers import DynamicCache


def token_logprobs(net, groups, temperature, device, max_pad=1.25):
    """Logprobs of every completion token of these groups under net, at the sampling temperature -> (logp, mask),
    [completions, longest completion], rows in group order. Each prompt runs once and its KV cache is shared by the
    group's completions (for short answers that halves the tokens); only completion positions reach the output
    layer. Completions then run in chunks of similar length (longest first, a chunk's padded area at most max_pad
    times its real tokens): padding is computed like any token, and one rambling answer would otherwise pad every
    row to its length. Prompts are left-padded, completions right-padded."""
    n = len(groups[0]["completions"])
    prompts = [g["prompt_ids"] for g in groups]
    comps = [c["ids"] for g in groups for c in g["completions"]]
    P, T = max(map(len, prompts)), max(map(len, comps))
    pids, cids = torch.zeros(len(prompts), P, dtype=torch.long), torch.zeros(len(comps), T, dtype=torch.long)
    pmask, cmask = torch.zeros_like(pids), torch.zeros_like(cids)
    for i, p in enumerate(prompts):
        pids[i, P - len(p):], pmask[i, P - len(p):] = torch.tensor(p), 1
    for i, c in enumerate(comps):
        cids[i, :len(c)], cmask[i, :len(c)] = torch.tensor(c), 1
    pids, pmask, cids, cmask = pids.to(device), pmask.to(device), cids.to(device), cmask.to(device)
    out = net(input_ids=pids, attention_mask=pmask, position_ids=(pmask.cumsum(1) - 1).clamp(min=0), use_cache=True,
              logits_to_keep=1)
    chunks, order = [], sorted(range(len(comps)), key=lambda i: -len(comps[i]))
    for i in order:  # longest first: a chunk's first row sets its padded length
        if chunks and (len(chunks[-1]) + 1) * len(comps[chunks[-1][0]]) <= max_pad * (real + len(comps[i])):
            chunks[-1].append(i)
            real += len(comps[i])
        else:
            chunks.append([i])
            real = len(comps[i])
    pieces = []
    for rows in chunks:
        idx, Tc = torch.tensor(rows, device=device), len(comps[rows[0]])
        logits = out.logits[idx // n, -1:]  # the prompt's last position predicts completion token 0
        if Tc > 1:  # a fresh cache holding these rows' prompts; the forward appends the completion to it
            cache = DynamicCache()
            for layer, kv in enumerate(out.past_key_values.layers):
                cache.update(kv.keys[idx // n], kv.values[idx // n], layer)
            pm = pmask[idx // n]
            pos = pm.sum(1, keepdim=True) + torch.arange(Tc - 1, device=device)
            rest = net(input_ids=cids[idx, :Tc - 1], attention_mask=torch.cat([pm, cmask[idx, :Tc - 1]], 1),
                       position_ids=pos, past_key_values=cache).logits
            logits = torch.cat([logits, rest], 1)
        logits = logits.float() / temperature
        lp = logits.gather(-1, cids[idx, :Tc].unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, -1)
        pieces.append(torch.nn.functional.pad(lp, (0, T - Tc)))
    logp = torch.cat(pieces)[torch.tensor(order, device=device).argsort()]  # back to group order
    return logp * cmask, cmask


def group_advantages(rewards, group_size, norm_std=False, eps=1e-6):
    """rewards: [num_groups * group_size] -> advantages of the same shape."""
    r = rewards.view(-1, group_size)
    adv = r - r.mean(dim=1, keepdim=True)
    if norm_std:
        adv = adv / (r.std(dim=1, keepdim=True) + eps)
    return adv.reshape(-1)


def grpo_loss(logp, behav_logp, adv, mask, n_tokens, eps_low=0.2, eps_high=0.28, tis_cap=3.0,
              ref_logp=None, kl_coef=0.0):
    """
    logp, behav_logp, mask: [B, T] (mask is 1 on completion tokens); adv: [B]; n_tokens: the number of completion
    tokens in the whole batch (all micro-batches, all ranks), so micro-batches and ranks add up to a token mean.
    Returns (loss, clipped): clipped marks the completion tokens the clip or the cap cut off from the gradient.
    """
    mask = mask.to(logp.dtype)
    log_ratio = logp - behav_logp
    ratio = torch.exp(log_ratio)
    a = adv.unsqueeze(1)
    pg = -a * ratio
    pg_clip = -a * ratio.clamp(1 - eps_low, 1 + eps_high)
    per_tok = torch.maximum(pg, pg_clip)
    per_tok = torch.where(a < 0, torch.minimum(per_tok, -a * tis_cap), per_tok)
    if kl_coef > 0:  # k3 estimator of KL(pi_theta || pi_ref), unbiased and >= 0
        d = ref_logp - logp
        per_tok = per_tok + kl_coef * (torch.exp(d) - d - 1)
    loss = (per_tok * mask).sum() / n_tokens
    clipped = ((pg_clip > pg) | ((a < 0) & (ratio > tis_cap))).detach() & (mask > 0)  # tokens that get no gradient
    return loss, clipped
