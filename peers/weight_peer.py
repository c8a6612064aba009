"""The vLLM side of bench.py's weight-sync ratio: a real engine whose worker joins the weight
groups (sync.join), then, REPEATS times, loads a push (sync.load) and takes one raw broadcast of
the same bytes on the same group. The trainer side is bench.weight_sync(). LORA_RANK > 0: the
engine serves an adapter, and a push is the adapter.
Usage: python peers/weight_peer.py MODEL_DIR PORT REPEATS [LORA_RANK]"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

import rollout  # noqa: E402  (sets VLLM_ENABLE_V1_MULTIPROCESSING before vllm is imported)
import sync  # noqa: E402


def raw(worker, numel):  # one broadcast of numel floats on the weights group
    worker.nanoasync.weights.broadcast(torch.empty(numel), 0).wait()


if __name__ == "__main__":
    model, port, repeats = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    rank = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    cfg = dict(model=model, rollout_dtype="float32", colocate=False, timeout_s=60, seed=0,
               max_model_len=128, enforce_eager=True, gpu_memory_utilization=0.5,
               tensor_parallel_size=1, kv_cache_gb=1, rollout_seqs=4, group_size=4, eval_n=0,
               rollout_port=port, stage_weights=True, host="127.0.0.1", engines=1,
               lora_rank=rank, lora_alpha=32, lora_targets="all-linear")
    llm = rollout.make_llm(cfg, "cpu")
    store = sync.open_store("127.0.0.1", port, False, 60)
    ctl, _ = sync.connect(store, 1, 1, 60)
    llm.collective_rpc(sync.join, args=(cfg, 0))
    for i in range(repeats):
        sync.broadcast_version(ctl)  # announced: received
        llm.collective_rpc(sync.load)
        store.set(f"loaded{i}", "1")
        store.wait([f"raw{i}"])
        llm.collective_rpc(raw, args=(int(store.get("numel")),))
