"""The vLLM side of test_sync.py: a real engine in its own process whose worker joins the weight
group (sync.join), samples, receives new weights inside the worker (sync.load), and samples again.
Usage: python vllm_peer.py MODEL_DIR PORT CONFIG_JSON"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import lora  # noqa: E402
import rollout  # noqa: E402  (sets VLLM_ENABLE_V1_MULTIPROCESSING before vllm is imported)
import sync  # noqa: E402

if __name__ == "__main__":
    from vllm import SamplingParams
    path, port, cfg = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
    llm = rollout.make_llm(dict(cfg, model=path, seed=0, max_model_len=128, enforce_eager=True,
                                rollout_seqs=4, group_size=4, eval_n=0,
                                gpu_memory_utilization=0.5, tensor_parallel_size=1, kv_cache_gb=1),
                           "cpu")
    store = sync.open_store("127.0.0.1", port, False, 60)
    cfg = dict(cfg, host="127.0.0.1", engines=1, tensor_parallel_size=1)
    ctl, _ = sync.connect(store, 1, 1, 60)
    llm.collective_rpc(sync.join, args=(cfg, 0))
    if cfg.get("newest"):  # test_a_busy_engine_gets_the_newest_weights: each step when told
        got = []
        while (cmd := store.get(f"cmd{len(got)}").decode()) != "end":
            got.append(sync.broadcast_version(ctl) if cmd == "ctl" else
                       llm.collective_rpc(sync.load)[0])
            store.set(f"did{len(got) - 1}", "")
        store.set("got", json.dumps(got))
        sys.exit(0)
    prompt = json.loads(store.get("prompt"))
    params = SamplingParams(n=4, temperature=0.7, max_tokens=16, logprobs=0)

    def sample():
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False,
                           lora_request=lora.request(cfg))[0]
        return [(list(c.token_ids), [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)])
                for c in out.outputs]

    samples = [sample()]
    for k in (1, 2):  # two pushes: the double buffers are reused across pushes too
        assert sync.broadcast_version(ctl) == k  # the version announced
        assert llm.collective_rpc(sync.load) == [k]
        store.set(f"loaded{k}", "")  # the test's next push: a sender sends only the newest
        llm.reset_prefix_cache()
        samples.append(sample())
    store.set("samples", json.dumps(samples))
