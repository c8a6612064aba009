"""The trainer's logprobs against vLLM's in one precision, on one model: bench.py --precision.

  python peers/precision.py MODEL DTYPE [PROMPTS] [TOKENS] [ENFORCE_EAGER]

vLLM, built as the pipeline builds it (rollout.make_llm), samples 8 answers of up to TOKENS
tokens to each of PROMPTS sums at T = 1 and reports each sampled token's logprob as it decodes.
Then, on the same tokens: vLLM again as one prefill (prompt_logprobs), and the trainer's own
code (loss.shard, loss.token_logprobs; compiled layers on a GPU, as train.py) in DTYPE and in
float32. Prints one JSON line: for each pair, the mean |difference| of the logprobs (the
pipeline's logprob_mismatch) and the k3 estimate of KL(vLLM || other) (its logprob_kl_k3).
"vllm_decode_vs_prefill" is vLLM against itself: a trainer that computed exactly what vLLM's
prefill computes would still be that far from the logprobs the sampler used."""
import json
import os
import sys

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import loss as L  # noqa: E402
import rollout  # noqa: E402  (sets VLLM_ENABLE_V1_MULTIPROCESSING before vllm is imported)


def sample(model, dtype, prompts, tokens, eager, device):
    """-> groups as the engine loop sends them (vLLM's decode logprobs), vLLM's prefill
    logprobs of the same completions [N], the engine."""
    from vllm import SamplingParams
    cfg = dict(model=model, rollout_dtype=dtype, seed=0, max_model_len=512, eval_n=0,
               enforce_eager=eager, gpu_memory_utilization=0.3, rollout_seqs=8 * prompts,
               tensor_parallel_size=1, kv_cache_gb=2)
    llm = rollout.make_llm(cfg, device.type)
    tok = llm.get_tokenizer()
    ids = [rollout.format_prompt(tok, f"What is {17 * i + 12} + {29 * i + 7}? Explain.")
           for i in range(prompts)]
    params = SamplingParams(n=8, temperature=1.0, max_tokens=tokens, logprobs=0)
    groups = []
    for p, out in zip(ids, llm.generate([{"prompt_token_ids": p} for p in ids], params)):
        comps = [dict(ids=list(c.token_ids), reward=0.0,
                      logprobs=np.array([d[t].logprob for d, t in zip(c.logprobs, c.token_ids)],
                                        np.float32),
                      versions=np.zeros(len(c.token_ids), np.int64),
                      mask=np.ones(len(c.token_ids), np.float32)) for c in out.outputs]
        groups.append({"prompt_ids": p, "completions": comps})
    pairs = [(g["prompt_ids"], c["ids"]) for g in groups for c in g["completions"]]
    again = llm.generate([{"prompt_token_ids": p + c} for p, c in pairs],
                         SamplingParams(max_tokens=1, prompt_logprobs=0))
    prefill = [d[t].logprob for (p, c), o in zip(pairs, again)
               for d, t in zip(o.prompt_logprobs[len(p):], c)]
    return groups, torch.tensor(prefill), llm


def trainer_logprobs(model, dtype, groups, device):  # [N], the completions' tokens in order
    from transformers import AutoModelForCausalLM
    net = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).to(device)
    L.shard(net, getattr(torch, dtype), compiled=True)
    out = []
    with torch.no_grad():
        for g in groups:
            batch = L.to_device(L.pack([g]), device)
            logp = L.token_logprobs(net, batch, 1.0)
            out += [logp[i, :len(c["ids"])] for i, c in enumerate(g["completions"])]
    return torch.cat(out).float().cpu()


def gap(a, b):  # b: vLLM's, as the pipeline's metrics
    d = (a - b).double()
    return {"mean_abs": d.abs().mean().item(), "k3": (torch.expm1(d) - d).mean().item()}


def main(model, dtype, prompts="4", tokens="96", eager="True"):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    groups, prefill, llm = sample(model, dtype, int(prompts), int(tokens), eager == "True",
                                  device)
    decode = torch.cat([torch.from_numpy(c["logprobs"]) for g in groups for c in g["completions"]])
    if not dist.is_initialized():  # vLLM may have made the one-rank group FSDP2 needs
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                store=dist.HashStore(), rank=0, world_size=1)
    ours = trainer_logprobs(model, dtype, groups, device)
    fp32 = trainer_logprobs(model, "float32", groups, device)
    print(json.dumps({"model": model, "dtype": dtype, "device": str(device), "tokens": len(decode),
                      "enforce_eager": eager == "True",
                      "trainer_vs_vllm_decode": gap(ours, decode),
                      "vllm_decode_vs_prefill": gap(prefill, decode),
                      "trainer_vs_float32": gap(ours, fp32),
                      "vllm_decode_vs_float32": gap(fp32, decode)}), flush=True)
    del llm


if __name__ == "__main__":
    main(*sys.argv[1:])
