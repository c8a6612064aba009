"""vLLM alone, as bench.py's baselines for the engine loop, on a run's train_config.json.

  python peers/vllm_alone.py generate CONFIG_JSON GROUPS STEPS [VARIANTS]
      LLM.generate over the loop's own prompt stream (rollout.Rollout.admit's order): the
      batches of GROUPS groups of those STEPS (e.g. 2,3,4), one LLM.generate call a batch, n =
      group_size. VARIANTS (comma-separated): "defaults" (vLLM's own output settings) and
      "loop_outputs" (the loop's: no detokenizing, flat logprobs; needs the engine core in this
      process). Prints {variant: generated tokens/s}.
  python peers/vllm_alone.py copy CONFIG_JSON
      Seconds to copy the model's weights into the engine (sync.copy_in, the engine's pause in
      a load), from tensors in memory; the median of 5. Prints {"copy_s": ...}.

Run it on the cores (or GPU) the loop's engine had: bench.py sets the environment.
"""
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import reward  # noqa: E402
import rollout  # noqa: E402  (sets VLLM_ENABLE_V1_MULTIPROCESSING before vllm is imported)
import sync  # noqa: E402


def generate(cfg, llm, groups, steps, variants):
    from vllm import SamplingParams
    tok, train_set = llm.get_tokenizer(), reward.load_task(cfg)["train"]
    perm = random.Random(f"{cfg['seed']}/0").sample(range(len(train_set)), len(train_set))
    batches = [[{"prompt_token_ids": rollout.format_prompt(tok, train_set[perm[k]]["prompt"])}
                for k in range(s * groups, (s + 1) * groups)] for s in steps]
    extra = {"defaults": {}, "loop_outputs": dict(detokenize=False, flat_logprobs=True)}
    out = {}
    for name in variants:
        params = SamplingParams(n=cfg["group_size"], temperature=cfg["temperature"], logprobs=0,
                                max_tokens=cfg["max_new_tokens"], **extra[name])
        llm.generate(batches[0][:4], params, use_tqdm=False)  # warm-up
        t, n = time.perf_counter(), 0
        for batch in batches:
            outs = llm.generate(batch, params, use_tqdm=False)
            n += sum(len(c.token_ids) for o in outs for c in o.outputs)
        out[name] = n / (time.perf_counter() - t)
    return out


def copy(cfg, llm):
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(cfg["model"],
                                                 dtype=getattr(torch, cfg["rollout_dtype"]))
    state = [(n, p.detach()) for n, p in model.named_parameters()]

    def timed(worker):
        t = time.perf_counter()
        sync.copy_in(worker, iter(state))
        return time.perf_counter() - t
    return {"copy_s": sorted(llm.collective_rpc(timed)[0] for _ in range(5))[2]}


if __name__ == "__main__":
    import torch
    what, cfg = sys.argv[1], json.load(open(sys.argv[2]))
    # e=1: the engine as the loop's, without engine 0's room for evals
    llm = rollout.make_llm(cfg, "cuda" if torch.cuda.is_available() else "cpu", e=1)
    if what == "generate":
        variants = (sys.argv[5] if len(sys.argv) > 5 else "defaults").split(",")
        result = generate(cfg, llm, int(sys.argv[3]), [int(s) for s in sys.argv[4].split(",")],
                          variants)
    else:
        result = copy(cfg, llm)
    print(json.dumps(result))
