"""
rollout.py: the generation process. Trainer rank 0 starts exactly one of these (`python rollout.py CONFIG_JSON`);
it owns a vLLM engine and never waits for the trainer.

The loop drives vLLM one engine step at a time (continuous batching) and between two steps:
  1. takes whatever the trainer sent (a receiver thread does the blocking receive): new weights are loaded into the
     running engine and the requests in flight just carry on with them (in-flight update); vLLM tags each output
     token with the weight version that sampled it;
  2. admits new prompt groups while staleness allows: the trainer trains batch k (k = 0, 1, ...) at version k, so a
     group started at version v is at most max_staleness old when trained iff fewer than
     (v - v0 + max_staleness + 1) * batch_groups groups have been admitted since the run started at version v0
     (0, or a checkpoint's), not counting discarded groups: flat ones (with drop_flat) it counts itself as it
     grades them, so their replacements start at once; stale ones the trainer reports.
     max_staleness = 0 is the synchronous baseline: generate one batch, wait for the next weights, repeat;
  3. grades finished groups (reward.py) and sends them to the trainer, with the sampled tokens' logprobs under the
     distribution that was actually sampled (logprobs_mode="processed_logprobs": log_softmax(logits / T)), and with
     "idle" set when nothing is left to do until new weights or a discard notice come (the trainer then borrows this
     process's CPU cores, see borrow_cpus in train.py).
Held-out eval (greedy, pass@1) runs in the same engine every eval_every versions; weight loads wait while an eval is
in flight, so each eval sees exactly one version.

The training prompts form one endless stream: position k is problem perm_e[k mod N] of epoch e = k // N, each epoch a
seeded shuffle. Every group carries its position, so a checkpoint can say exactly which ones the trainer consumed and a
resumed run regenerates the rest (those that were in flight or waiting in the buffer) from the checkpointed weights.

Simplifications: one engine in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0; with tensor_parallel_size > 1 vLLM
starts its own workers); no top-k / top-p (the behaviour logprobs would then be of a truncated distribution, which the
trainer does not model). SIGINT and SIGTERM are ignored: this process belongs to trainer rank 0, which stops it (or
takes it down with it) after writing its checkpoint.
"""
import ctypes
import json
import os
import queue
import random
import resource
import signal
import sys
import threading
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # before vllm is imported: engine and model stay here
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # its CPU warnings repeat by the dozen; set it to see them


def receive(ctl, buckets, dtype, device, inbox):
    """Receiver thread: block on the trainer's messages, hand them to the engine loop. An error (the trainer died and
    the group timed out) is handed on too, so the loop can exit instead of hanging."""
    import sync
    try:
        while True:
            version, discarded, has_weights, stop = sync.recv_header(ctl, device)
            weights = sync.recv_weights(ctl, buckets, dtype, device) if has_weights else None
            inbox.put((version, discarded, weights, stop))
            if stop:
                return
    except Exception as e:
        inbox.put(e)


def load_weights(worker, weights):
    """Runs inside the vLLM worker (collective_rpc): reload in place, with vLLM's own post-load processing."""
    worker.model_runner.reload_weights(weights_iterator=iter(weights))
    model = worker.model_runner.get_model()
    if getattr(model.config, "tie_word_embeddings", False) and hasattr(model, "lm_head"):
        from vllm.platforms import current_platform
        if current_platform.is_cpu():  # the CPU backend repacks the output layer; re-pack it from the tied weight
            from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
            dispatch_cpu_unquantized_gemm(model.lm_head, remove_weight=False)


def format_prompt(tok, text):
    if tok.chat_template:
        text = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
        return tok.encode(text, add_special_tokens=False)
    return tok.encode(text)


def make_llm(cfg, device, **extra):
    """The vLLM engine as the rollout process runs it (bench.py times the same one standalone)."""
    from vllm import LLM
    if device == "cpu":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cfg["kv_cache_gb"]))
    # prefix caching shares whole KV blocks only: at the CPU default of 128 tokens per block a group's samples would
    # each recompute their ~40-token prompt, at 32 they share its first 32 (SmolLM2, one core: 111 -> 157 tokens/s)
    return LLM(model=cfg["model"], dtype=cfg["rollout_dtype"], seed=cfg["seed"], max_model_len=cfg["max_model_len"],
               enforce_eager=cfg["enforce_eager"], gpu_memory_utilization=cfg["gpu_memory_utilization"],
               tensor_parallel_size=cfg["tensor_parallel_size"], logprobs_mode="processed_logprobs",
               enable_prefix_caching=True, block_size=32 if device == "cpu" else None, **extra)


def main(cfg):
    import torch
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind
    import reward
    import sync
    from buffer import is_flat

    try:  # die with trainer rank 0, whatever killed it
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    parent = os.getppid()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    llm = make_llm(cfg, device)
    engine, tok = llm.llm_engine, llm.get_tokenizer()
    train_set, eval_set = reward.load_task(cfg)
    limit = cfg["max_model_len"] - cfg["max_new_tokens"]
    encoded = {}

    def encode(problem):  # -> token ids, or None when the prompt leaves no room for the completion
        if problem["prompt"] not in encoded:
            ids = list(format_prompt(tok, problem["prompt"]))
            encoded[problem["prompt"]] = ids if len(ids) <= limit else None
        return encoded[problem["prompt"]]

    ctl, traj, store = sync.connect(cfg["rollout_host"], cfg["rollout_port"], 1, device, cfg["timeout_s"])
    start = sync.recv_obj(ctl, 0, device)  # weight layout; where the run starts: version and prompt stream position
    dtype = getattr(torch, cfg["rollout_dtype"])
    buckets = sync.plan_buckets(start["meta"], cfg["bucket_mb"], dtype)
    v0 = version = start["version"]
    if v0 > 0:  # a resumed run: the checkpointed weights come first, before any generation
        sync.recv_header(ctl, device)
        llm.collective_rpc(load_weights, args=(sync.recv_weights(ctl, buckets, dtype, device),))
        llm.reset_prefix_cache()
    inbox = queue.Queue()
    threading.Thread(target=receive, args=(ctl, buckets, dtype, device, inbox), daemon=True).start()

    sample = SamplingParams(n=cfg["group_size"], temperature=cfg["temperature"], max_tokens=cfg["max_new_tokens"],
                            logprobs=0, output_kind=RequestOutputKind.FINAL_ONLY)
    greedy = SamplingParams(n=1, temperature=0.0, max_tokens=cfg["max_new_tokens"],
                            output_kind=RequestOutputKind.FINAL_ONLY)
    done, perm = set(start["done"]), {}

    def stream(k):  # the training prompt stream from position k on, minus what the trainer consumed before a resume
        while True:
            if k not in done:
                epoch, i = divmod(k, len(train_set))
                if epoch not in perm:  # a fresh seeded shuffle per epoch, a function of (seed, epoch) alone
                    perm.clear()
                    perm[epoch] = random.Random(f"{cfg['seed']}/{epoch}").sample(range(len(train_set)), len(train_set))
                yield k, train_set[perm[epoch][i]]
            k += 1

    prompts = stream(start["next"])
    discarded, admitted, flat = 0, 0, 0  # since this process started: the trainer counts discards from there too
    pending = None  # newest weights received and not loaded yet
    inflight, evals = {}, {}  # request id -> (problem, version at admission); eval request id -> problem
    eval_correct, eval_n = 0, 0
    # cumulative, sent with every group: failures, and where the rollout's time goes (for bench.py)
    counters = {"reward_failed": 0, "skipped_long": 0, "rollout_engine_s": 0.0, "rollout_load_s": 0.0,
                "rollout_tokens": 0, "rollout_rss_mb": 0.0}
    B, eta = cfg["batch_groups"], cfg["max_staleness"]
    engine.set_weight_version(str(version))

    def start_eval():
        nonlocal eval_n
        for p in eval_set:
            ids = encode(p)
            if ids is not None:
                rid = f"eval-{version}-{p['id']}"
                evals[rid] = p
                eval_n += 1
                engine.add_request(rid, {"prompt_token_ids": ids, "cache_salt": f"v{version}"}, greedy)

    def waiting():  # nothing in flight and nothing admissible until new weights or a discard notice arrive
        if inflight or evals or pending or admitted - flat - discarded < (version - v0 + eta + 1) * B:
            return None
        return [version, discarded]  # the trainer may borrow this process's cores until either changes

    if cfg["eval_every"] > 0:
        start_eval()
    while True:
        # 1. messages from the trainer; block briefly only when there is nothing else to do
        idle = not engine.has_unfinished_requests()
        while True:
            try:
                msg = inbox.get(timeout=0.05) if idle else inbox.get_nowait()
            except queue.Empty:
                break
            idle = False
            if isinstance(msg, Exception):
                raise RuntimeError(f"lost the trainer: {msg}")
            v, discarded, weights, stop = msg
            if stop:
                sync.send_obj(traj, {"kind": "bye", **counters}, 0, device)
                return
            if weights is not None:
                pending = (v, weights)
        if os.getppid() != parent:
            raise RuntimeError("the trainer process is gone")
        # weights load between engine steps; the requests in flight keep going on the new ones
        if pending is not None and not evals:
            version, weights = pending
            pending = None
            t0 = time.perf_counter()
            llm.collective_rpc(load_weights, args=(weights,))
            llm.reset_prefix_cache()  # does nothing while requests hold blocks; the per-version cache_salt covers that
            engine.set_weight_version(str(version))
            counters["rollout_load_s"] += time.perf_counter() - t0
            if cfg["eval_every"] > 0 and (version % cfg["eval_every"] == 0 or version == cfg["max_steps"]):
                start_eval()
        # 2. admission control: bounded staleness
        while len(inflight) < cfg["rollout_groups"] and admitted - flat - discarded < (version - v0 + eta + 1) * B:
            pos, problem = next(prompts)
            ids = encode(problem)
            if ids is None:
                counters["skipped_long"] += 1
                if counters["skipped_long"] >= len(train_set) and not any(map(encode, train_set)):
                    raise ValueError(f"no training prompt fits in max_model_len - max_new_tokens = {limit} tokens: "
                                     "raise max_model_len or lower max_new_tokens")
                continue
            rid = f"g{admitted}"
            inflight[rid] = (pos, problem, version)
            engine.add_request(rid, {"prompt_token_ids": ids, "cache_salt": f"v{version}"}, sample)
            admitted += 1
        if not engine.has_unfinished_requests():
            continue
        # 3. one engine step; finished groups are graded and sent
        t0 = time.perf_counter()
        outs = engine.step()
        counters["rollout_engine_s"] += time.perf_counter() - t0
        for out in outs:
            if not out.finished:
                continue
            if out.request_id in evals:
                p = evals.pop(out.request_id)
                eval_correct += reward.score(out.outputs[0].text, p["answer"], cfg["reward_timeout_s"])[0] == 1.0
                if not evals:
                    sync.send_obj(traj, {"kind": "eval", "version": version, "eval_n": eval_n,
                                         "eval_accuracy": eval_correct / eval_n, "idle": waiting()}, 0, device)
                    eval_correct = eval_n = 0
                continue
            pos, problem, v_start = inflight.pop(out.request_id)
            completions = []
            for c in out.outputs:
                r, failed = reward.score(c.text, problem["answer"], cfg["reward_timeout_s"])
                counters["reward_failed"] += failed
                spans = [(int(s.version), s.start, s.end) for s in c.weight_versions or []] or [(v_start, 0, len(c.token_ids))]
                completions.append({"ids": list(c.token_ids), "reward": r, "spans": spans,
                                    "logprobs": [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)],
                                    "version_min": min(v for v, *_ in spans), "version_max": max(v for v, *_ in spans)})
            flat += cfg["drop_flat"] and is_flat({"completions": completions})  # the trainer will skip it
            counters["rollout_tokens"] += sum(len(c["ids"]) for c in completions)
            counters["rollout_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            sync.send_obj(traj, {"kind": "group", "pos": pos, "prompt_ids": encode(problem),
                                 "completions": completions, "version_min": min(c["version_min"] for c in completions),
                                 "version_max": max(c["version_max"] for c in completions), "idle": waiting(),
                                 **counters}, 0, device)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # torchrun signals rank 0's whole process group; rank 0 stops us
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        main(json.loads(sys.argv[1]))
    except Exception as e:
        print(f"rollout: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        raise
