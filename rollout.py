"""
rollout.py: generation. Trainer rank 0 starts `rollout_engines` rollout processes (spawn()), one per vLLM engine,
each on its own GPUs (or, with colocate, on the trainer's). None of them ever waits for the trainer.

Each process drives its engine one step at a time (continuous batching) and between two steps:
  1. loads new weights when the trainer has announced them: every worker receives them itself (sync.load);
     the requests in flight carry on with the new weights (in-flight update). Every token is tagged with the
     version of the weights that computed it: vLLM runs with async_scheduling off, so the tokens one step()
     returns were computed in that step, after every load before it;
  2. admits prompt groups while the staleness bound allows (take_ticket: one budget for all engines, kept in the
     trainer's TCPStore);
  3. grades finished groups (reward.py) and sends them to the trainer with the sampled tokens' logprobs under the
     distribution actually sampled (logprobs_mode="processed_logprobs": log_softmax(logits / T)).
Held-out eval (greedy, pass@1) runs in engine 0 every eval_every versions; its weight loads wait while an eval is
in flight, so each eval sees exactly one version. The push of new weights reaches every engine at once, so while a
load waits for an eval, every engine and the trainer wait too: engine 0 then admits nothing new, and an eval must
end within timeout_s.

The training prompts form one endless stream: position k is problem perm_e[k mod N] of epoch e = k // N, each epoch
a seeded shuffle. Engines take positions from a shared counter; every group carries its position, so a checkpoint
can say exactly which ones the trainer consumed, and a resumed run regenerates the rest.

Simplifications: one process per engine, because a process is what vLLM places on devices (the engine core runs
in it, VLLM_ENABLE_V1_MULTIPROCESSING=0; with tensor_parallel_size > 1 vLLM starts its workers as processes);
n = 1 requests, a group being group_size requests that share the prompt's KV cache; no top-k / top-p (the
behaviour logprobs would be of a truncated distribution). SIGINT and SIGTERM are ignored: these processes belong
to trainer rank 0, which stops them (or takes them down with it) after writing its checkpoint.
"""
import ctypes
import json
import os
import pickle
import queue
import random
import resource
import signal
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.abspath(__file__))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # before vllm is imported: the engine core stays here
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # its CPU warnings repeat by the dozen; set it to see them
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc(sync.load) to worker processes
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
                "ROLE_RANK", "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE", "OMP_NUM_THREADS")


def placement(cfg, world, local_world, gpus):
    """GPUs of this node for each engine -> [[gpu, ...] per engine]; raises ValueError with the fix."""
    E, tp = cfg["rollout_engines"], cfg["tensor_parallel_size"]
    if cfg["colocate"]:  # one GPU shared by the trainer and vLLM (CUDA IPC needs them on the same device)
        if world != 1 or E * tp != 1:
            raise ValueError(f"colocate on GPUs runs 1 trainer rank and 1 engine with tensor_parallel_size=1 on "
                             f"one GPU (got {world} ranks, rollout_engines={E}, tensor_parallel_size={tp}): use "
                             "--nproc_per_node=1, or drop --colocate to give vLLM GPUs of its own")
        return [gpus[:1]]
    if local_world + E * tp > len(gpus):
        raise ValueError(f"{local_world} trainer ranks + {E} engines x tensor_parallel_size={tp} need "
                         f"{local_world + E * tp} GPUs, this node has {len(gpus)}: use fewer --nproc_per_node, "
                         "--rollout_engines or --tensor_parallel_size, or --colocate on one GPU")
    return [gpus[local_world + e * tp:local_world + (e + 1) * tp] for e in range(E)]


def place(cfg, world, local_world, device, master):
    """-> (GPUs of the first node for each engine, CPU cores the trainer may borrow). CPU: vLLM on rollout_cpus,
    the trainer ranks on the other cores, as two GPUs would be. Raises ValueError with the fix."""
    engine_gpus, borrow = [[] for _ in range(cfg["rollout_engines"])], 0
    if device.type == "cuda":
        import torch
        torch.cuda.set_device(device)
        if master:
            gpus = os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(torch.cuda.device_count()))))
            engine_gpus = placement(cfg, world, local_world, gpus.split(","))
    elif cfg["rollout_cpus"]:
        # vLLM sits idle once it has generated all that staleness allows, until the next weights (a synchronous
        # run's whole training phase); a lone trainer rank then runs more threads, on vLLM's cores too
        cores = cpus(cfg["rollout_cpus"])
        borrow = len(cores) if cfg["borrow_cpus"] and world == 1 else 0
        if not borrow:
            os.sched_setaffinity(0, os.sched_getaffinity(0) - cores)
    return engine_gpus, borrow


def cpus(spec):
    """rollout_cpus "1" or "2-3" -> {cores}"""
    lo, _, hi = spec.partition("-")
    return set(range(int(lo), int(hi or lo) + 1))


def spawn(cfg, engine_gpus):
    """Start one rollout process per engine; they must not mistake themselves for torchrun ranks."""
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV and not k.startswith("TORCHELASTIC")}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")  # vLLM's worker processes import sync
    if cfg["rollout_cpus"]:
        env.update(VLLM_CPU_OMP_THREADS_BIND=cfg["rollout_cpus"], OMP_NUM_THREADS=str(len(cpus(cfg["rollout_cpus"]))))
    procs = []
    for e, gpus in enumerate(engine_gpus):
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
        procs.append(subprocess.Popen([sys.executable, os.path.join(ROOT, "rollout.py"), json.dumps(cfg), str(e)],
                                      env=env))
    return procs


def format_prompt(tok, text):
    if tok.chat_template:
        text = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                       tokenize=False)
        return tok.encode(text, add_special_tokens=False)
    return tok.encode(text)


def make_llm(cfg, device, **extra):
    """The vLLM engine as the rollout process runs it (bench.py times the same one standalone)."""
    from vllm import LLM
    if device == "cpu":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cfg["kv_cache_gb"]))
    # prefix caching shares whole KV blocks only: at the CPU default of 128 tokens per block a group's samples
    # would each recompute their prompt, at 32 they share all but its last partial block.
    # async_scheduling=False: step() returns the tokens computed in that step, so a token sampled before a
    # weight load is never tagged with the new version.
    return LLM(model=cfg["model"], dtype=cfg["rollout_dtype"], seed=cfg["seed"], max_model_len=cfg["max_model_len"],
               enforce_eager=cfg["enforce_eager"], gpu_memory_utilization=cfg["gpu_memory_utilization"],
               tensor_parallel_size=cfg["tensor_parallel_size"], logprobs_mode="processed_logprobs",
               enable_prefix_caching=True, block_size=32 if device == "cpu" else None, async_scheduling=False,
               **extra)


def budget(store, version, v0, cfg):
    """The staleness bound, one budget for every engine. The trainer trains batch k at version k, so a group
    admitted at version v is at most max_staleness old when trained iff fewer than
    (v - v0 + max_staleness + 1) * batch_groups groups were admitted before it since the run started at v0,
    not counting discarded ones (flat groups the engines count as they grade them, stale ones the trainer).
    Returns (groups allowed in all, discarded so far)."""
    discarded = store.add("discarded", 0)
    return (version - v0 + cfg["max_staleness"] + 1) * cfg["batch_groups"] + store.add("flat", 0) + discarded, \
        discarded


def take_ticket(store, version, v0, cfg):
    """Admit one more group if the budget allows -> (admitted, discarded so far)."""
    allowed, discarded = budget(store, version, v0, cfg)
    if store.add("admitted", 1) <= allowed:
        return True, discarded
    store.add("admitted", -1)  # over: give it back (others may briefly see one too many and retry later)
    return False, discarded


def receive(ctl, inbox):
    """Receiver thread: block on the trainer's headers, hand them to the engine loop; an error (the trainer died
    and the group timed out) too, so the loop exits instead of hanging."""
    import sync
    try:
        while True:
            msg = sync.recv_header(ctl)
            inbox.put(msg)
            if msg[2]:
                return
    except Exception as e:
        inbox.put(e)


class Rollout:
    """One engine's loop, and what it keeps between two engine steps."""

    def __init__(self, cfg, engine):
        import torch
        import reward
        import sync
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind
        self.cfg, self.e, self.parent = cfg, engine, os.getppid()
        self.llm = make_llm(cfg, "cuda" if torch.cuda.is_available() else "cpu")
        self.engine, self.tok = self.llm.llm_engine, self.llm.get_tokenizer()
        self.train_set, self.eval_set = reward.load_task(cfg)
        host, port, timeout = cfg["rollout_host"], cfg["rollout_port"], cfg["timeout_s"]
        self.store = sync.open_store(host, port, False, timeout)
        self.store.set(f"joined{engine}", "1")
        self.ctl, self.traj = sync.connect(self.store, 1 + engine, cfg["rollout_engines"], timeout)
        tp = cfg["tensor_parallel_size"]
        self.llm.collective_rpc(sync.join, args=(host, port, 1 + engine * tp, 1 + cfg["rollout_engines"] * tp, cfg))
        start = pickle.loads(self.store.get("start"))  # where the run starts: version, prompt stream position
        self.v0 = self.version = start["version"]
        self.done, self.first = set(start["done"]), start["next"]
        self.sample = SamplingParams(n=1, temperature=cfg["temperature"], max_tokens=cfg["max_new_tokens"],
                                     logprobs=0, output_kind=RequestOutputKind.DELTA)
        self.greedy = SamplingParams(n=1, temperature=0.0, max_tokens=cfg["max_new_tokens"],
                                     output_kind=RequestOutputKind.FINAL_ONLY)
        self.groups, self.evals, self.encoded, self.perm = {}, {}, {}, {}
        self.pending, self.retry_at, self.discarded, self.idle, self.n_admitted = None, 0.0, 0, None, 0
        self.at_bound = False  # the last ticket was refused: nothing more to admit until a load or a discard
        self.eval_correct = 0
        # cumulative, sent with every message: failures, and where this engine's time goes (for bench.py)
        self.counters = {"reward_failed": 0, "skipped_long": 0, "rollout_engine_s": 0.0, "rollout_load_s": 0.0,
                         "rollout_tokens": 0, "rollout_rss_mb": 0.0}
        self.inbox = queue.Queue()
        threading.Thread(target=receive, args=(self.ctl, self.inbox), daemon=True).start()

    def encode(self, problem):  # -> token ids, or None when the prompt leaves no room for the completion
        if problem["prompt"] not in self.encoded:
            ids = list(format_prompt(self.tok, problem["prompt"]))
            fits = len(ids) <= self.cfg["max_model_len"] - self.cfg["max_new_tokens"]
            self.encoded[problem["prompt"]] = ids if fits else None
        return self.encoded[problem["prompt"]]

    def problem(self, k):  # stream position k: a fresh seeded shuffle per epoch, a function of (seed, epoch)
        epoch, i = divmod(k, len(self.train_set))
        if epoch not in self.perm:
            self.perm = {epoch: random.Random(f"{self.cfg['seed']}/{epoch}").sample(range(len(self.train_set)),
                                                                                     len(self.train_set))}
        return self.train_set[self.perm[epoch][i]]

    def messages(self):
        """Take what the trainer sent; block briefly only when there is nothing else to do. False: stop."""
        block = not self.engine.has_unfinished_requests()
        while True:
            try:
                msg = self.inbox.get(timeout=0.05) if block else self.inbox.get_nowait()
            except queue.Empty:
                return True
            block = False
            if isinstance(msg, Exception):
                raise RuntimeError(f"lost the trainer: {msg}")
            version, has_weights, stop = msg
            if stop:
                return False
            if has_weights:
                self.pending = version

    def load(self):
        """Every worker receives the new weights itself; the requests in flight go on with them."""
        import sync
        t0 = time.perf_counter()
        self.llm.collective_rpc(sync.load)
        self.llm.reset_prefix_cache()  # a no-op while requests hold blocks; the per-version cache_salt covers that
        self.version, self.pending, self.retry_at, self.at_bound = self.pending, None, 0.0, False
        self.counters["rollout_load_s"] += time.perf_counter() - t0
        every = self.cfg["eval_every"]
        if self.e == 0 and every > 0 and (self.version % every == 0 or self.version == self.cfg["max_steps"]):
            self.start_eval()

    def start_eval(self):
        for p in self.eval_set:
            ids = self.encode(p)
            if ids is not None:
                rid = f"eval-{self.version}-{p['id']}"
                self.evals[rid] = p
                self.engine.add_request(rid, {"prompt_token_ids": ids, "cache_salt": f"v{self.version}"},
                                        self.greedy)
        self.eval_n = len(self.evals)

    def admit(self):
        """Start new groups while the shared staleness budget allows."""
        if self.evals and self.pending is not None:  # every engine waits in the load for this eval to end:
            return  # give the engine to the eval
        while len(self.groups) < self.cfg["rollout_groups"] and time.monotonic() >= self.retry_at:
            ok, self.discarded = take_ticket(self.store, self.version, self.v0, self.cfg)
            self.at_bound = not ok
            if not ok:
                self.retry_at = time.monotonic() + 0.01  # the budget grows with a load or a discard
                return
            ids = None
            while ids is None:
                k = self.first + self.store.add("pos", 1) - 1
                if k in self.done:
                    continue
                problem = self.problem(k)
                ids = self.encode(problem)
                if ids is None:
                    self.counters["skipped_long"] += 1
                    if self.counters["skipped_long"] >= len(self.train_set) and not any(
                            map(self.encode, self.train_set)):
                        raise ValueError("no training prompt fits in max_model_len - max_new_tokens: raise "
                                         "max_model_len or lower max_new_tokens")
            gid = f"g{self.n_admitted}"
            self.n_admitted += 1
            self.groups[gid] = {"pos": k, "problem": problem, "left": self.cfg["group_size"],
                                "comps": [{"ids": [], "logprobs": [], "versions": [], "text": ""}
                                          for _ in range(self.cfg["group_size"])]}
            for i in range(self.cfg["group_size"]):
                self.engine.add_request(f"{gid}/{i}", {"prompt_token_ids": ids,
                                                       "cache_salt": f"v{self.version}"}, self.sample)

    def step(self):
        """One engine step; every new token is tagged with the version loaded now."""
        t0 = time.perf_counter()
        outs = self.engine.step()
        self.counters["rollout_engine_s"] += time.perf_counter() - t0
        for out in outs:
            if out.request_id in self.evals:
                if out.finished:
                    self.finish_eval(out)
                continue
            gid, i = out.request_id.rsplit("/", 1)
            g, o = self.groups[gid], out.outputs[0]
            c = g["comps"][int(i)]
            c["ids"] += o.token_ids
            c["logprobs"] += [lp[t].logprob for t, lp in zip(o.token_ids, o.logprobs)]
            c["versions"] += [self.version] * len(o.token_ids)
            c["text"] += o.text
            if out.finished:
                g["left"] -= 1
                if not g["left"]:
                    self.finish_group(self.groups.pop(gid))

    def finish_eval(self, out):
        import reward
        import sync
        p = self.evals.pop(out.request_id)
        self.eval_correct += reward.score(out.outputs[0].text, p["answer"], self.cfg["reward_timeout_s"])[0] == 1
        if not self.evals:
            sync.send_obj(self.traj, {"kind": "eval", "version": self.version, "eval_n": self.eval_n,
                                      "eval_accuracy": self.eval_correct / self.eval_n, "engine": self.e,
                                      **self.counters}, 0)
            self.eval_correct = 0

    def finish_group(self, g):
        import reward
        import sync
        from buffer import is_flat
        for c in g["comps"]:
            c["reward"], failed = reward.score(c["text"], g["problem"]["answer"], self.cfg["reward_timeout_s"])
            self.counters["reward_failed"] += failed
            self.counters["rollout_tokens"] += len(c["ids"])
        msg = {"kind": "group", "pos": g["pos"], "prompt": g["problem"]["prompt"], "engine": self.e,
               "prompt_ids": self.encode(g["problem"]),
               "completions": g["comps"], "version_min": min(min(c["versions"], default=self.version)
                                                             for c in g["comps"]),
               "version_max": max(max(c["versions"], default=self.version) for c in g["comps"])}
        if self.cfg["drop_flat"] and is_flat(msg):  # the trainer will skip it: its replacement may start now
            self.store.add("flat", 1)
        if not (self.groups or self.evals or self.pending is not None):  # the last one in flight: idle from now?
            allowed, self.discarded = budget(self.store, self.version, self.v0, self.cfg)
            self.at_bound = self.store.add("admitted", 0) >= allowed
            self.mark_idle()  # before the trainer can see this group and check
        self.counters["rollout_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        sync.send_obj(self.traj, {**msg, **self.counters}, 0)

    def mark_idle(self):
        """Tell the trainer (store key idle{e}) when this engine has nothing to do until new weights or a discard:
        on CPU a lone trainer rank then borrows its cores (borrow_cpus in train.py)."""
        idle = not (self.groups or self.evals or self.pending is not None) and self.at_bound
        mark = f"{self.version}/{self.discarded}" if idle else ""
        if mark != self.idle:
            self.store.set(f"idle{self.e}", mark)
            self.idle = mark

    def run(self):
        import sync
        if self.v0 > 0:  # a resumed run: the checkpointed weights come first, before any generation
            while self.pending is None:
                self.messages()
            self.load()
        if self.e == 0 and self.cfg["eval_every"] > 0 and not self.evals:
            self.start_eval()
        while self.messages():
            if os.getppid() != self.parent:
                raise RuntimeError("the trainer process is gone")
            if self.pending is not None and not self.evals:
                self.load()
            self.admit()
            self.mark_idle()
            if self.engine.has_unfinished_requests():
                self.step()
        sync.send_obj(self.traj, {"kind": "bye", "engine": self.e, **self.counters}, 0)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # torchrun signals rank 0's process group; rank 0 stops us
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:  # die with trainer rank 0, whatever killed it
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    config = json.loads(sys.argv[1])
    if config["rollout_cpus"]:  # CPU: vLLM on its own cores, as it would be on its own GPU
        os.sched_setaffinity(0, cpus(config["rollout_cpus"]))
    try:
        Rollout(config, int(sys.argv[2])).run()
    except Exception as e:
        print(f"rollout {sys.argv[2]}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        raise
