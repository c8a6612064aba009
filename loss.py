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
decide the answer. Measured on the CPU demo (eta = 1, two seeds), that clip cut 2.6-2.8% of stale tokens and async
fell more than its one version of staleness behind sync (mean train reward of its last nine of ten steps: 0.35 and
0.36, against 0.47 and 0.50 for sync's first nine); with the truncated weight it is one version behind, no more (0.48
and 0.49). See README "Off-policy correction: measured".

token_logprobs() scores the sampled tokens under the trainer's model the way the sampler drew them:
log_softmax(logits / T), the same distribution vLLM reports with logprobs_mode="processed_logprobs".

Simplifications: one optimizer step per batch (so no separate "old policy" pass and no clip); the optional KL to a
reference policy uses the k3 estimator per token.
"""
import torch
from transformers import DynamicCache


def token_logprobs(net, groups, temperature, device, max_pad=1.1, width=0):
    """Logprobs of every completion token of these groups under net, at the sampling temperature -> (logp, mask),
    [completions, longest completion], rows in group order. Each prompt runs once and its KV cache is shared by the
    group's completions (for short answers that halves the tokens); only completion positions reach the output
    layer. Completions then run in chunks of similar length (longest first, a chunk's padded area at most max_pad
    times its real tokens): padding is computed like any token, and one rambling answer would otherwise pad every
    row to its length. Prompts are left-padded, completions right-padded. width > 0: one chunk, every row padded to
    width (FSDP over several ranks needs the same forward calls on every rank, whatever its completions' lengths)."""
    n = len(groups[0]["completions"])
    prompts = [g["prompt_ids"] for g in groups]
    comps = [c["ids"] for g in groups for c in g["completions"]]
    P, T = max(map(len, prompts)), max(max(map(len, comps)), width)
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
    for i in order:  # longest first: a chunk's first row sets its padded length (width: all rows in one chunk)
        if chunks and (width or (len(chunks[-1]) + 1) * len(comps[chunks[-1][0]]) <= max_pad * (real + len(comps[i]))):
            chunks[-1].append(i)
            real += len(comps[i])
        else:
            chunks.append([i])
            real = len(comps[i])
    pieces = []
    for rows in chunks:
        idx, Tc = torch.tensor(rows, device=device), width or len(comps[rows[0]])
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
