"""
rollout.py: one process per vLLM engine, stepped by hand and never waiting for the trainer. Between
two engine steps it loads announced weights (requests in flight go on; each token is tagged with
the version that computed it), admits groups under the staleness bound, hands answers to grader
processes and sends graded groups to trainer rank 0. Engine 0 also runs the greedy eval.
Simplifications: the engine core runs in this process; a group is n=1 requests sharing their
prompt's KV cache; no top-k/top-p (the logprobs would be of a truncated distribution).
"""
import ctypes
import json
import os
import queue
import random
import resource
import signal
import subprocess
import sys
import threading
import time
import traceback

import reward
import sync
from configurator import die

ROOT = os.path.dirname(os.path.abspath(__file__))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # before vllm is imported
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # its CPU warnings repeat by the dozen
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc(sync.load)
TORCHRUN_ENV = ("RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT GROUP_RANK "
                "ROLE_RANK ROLE_WORLD_SIZE GROUP_WORLD_SIZE OMP_NUM_THREADS").split()
COUNTERS = ("reward_failed skipped_long rollout_tokens rollout_engine_s rollout_load_s "
            "rollout_grade_s rollout_rss_mb").split()  # cumulative, sent with every message


def place(cfg, world, local_world, device, master):
    """-> (each engine's GPUs, after node 0's trainer ranks; cores a lone CPU rank may borrow)."""
    E, tp = cfg["rollout_engines"], cfg["tensor_parallel_size"]
    if device.type == "cpu":
        cores = cpus(cfg["rollout_cpus"])  # vLLM's cores, as a GPU of its own would be
        borrow = len(cores) if cfg["borrow_cpus"] and world == 1 else 0  # borrow_cpus
        if cores and not borrow:
            os.sched_setaffinity(0, os.sched_getaffinity(0) - cores)
        return [[] for _ in range(E)], borrow
    import torch
    torch.cuda.set_device(device)
    gpus = os.environ.get("CUDA_VISIBLE_DEVICES") or ",".join(
        map(str, range(torch.cuda.device_count())))
    gpus, first = gpus.split(","), 0 if cfg["colocate"] else local_world
    if master and cfg["colocate"] and world * E * tp != 1:  # CUDA IPC: one device
        die("colocate runs 1 trainer rank and 1 engine with tensor_parallel_size=1 on one GPU: "
            "--nproc_per_node=1 --rollout_engines=1 --tensor_parallel_size=1, or no --colocate")
    if master and first + E * tp > len(gpus):
        die(f"{local_world} trainer ranks + {E} engines x tensor_parallel_size={tp} need more than "
            f"the {len(gpus)} GPUs here: fewer trainer ranks or --rollout_engines, or --colocate")
    # only rank 0 starts engines: node 0 may have fewer trainer ranks than others
    return [gpus[first + e * tp:first + (e + 1) * tp] for e in range(E)] if master else [], 0


def cpus(spec):  # rollout_cpus "1" or "2-3" -> {cores}
    lo, _, hi = spec.partition("-")
    return set(range(int(lo), int(hi or lo) + 1)) if spec else set()


def spawn(cfg, engine_gpus):
    """One rollout process per engine; they must not take themselves for torchrun ranks."""
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV and "TORCHELASTIC" not in k}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")  # vLLM workers import sync
    if spec := cfg["rollout_cpus"]:
        env.update(VLLM_CPU_OMP_THREADS_BIND=spec, OMP_NUM_THREADS=str(len(cpus(spec))))
    return [subprocess.Popen([sys.executable, f"{ROOT}/rollout.py", json.dumps(cfg), str(e)],
                             env=dict(env, CUDA_VISIBLE_DEVICES=",".join(gpus)) if gpus else env)
            for e, gpus in enumerate(engine_gpus)]


def format_prompt(tok, text):
    if not tok.chat_template:
        return tok.encode(text)
    text = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                   tokenize=False)
    return tok.encode(text, add_special_tokens=False)


def make_llm(cfg, device, **extra):  # the engine, here and in bench.py
    from vllm import LLM
    if device == "cpu":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cfg["kv_cache_gb"]))
    # async_scheduling off: step() returns the tokens computed in it. processed_logprobs: those of
    # the distribution actually sampled. Prefix caching shares whole blocks: at the CPU default of
    # 128 tokens a group's samples would each recompute their prompt
    return LLM(model=cfg["model"], dtype=cfg["rollout_dtype"], seed=cfg["seed"],
               max_model_len=cfg["max_model_len"], enforce_eager=cfg["enforce_eager"],
               gpu_memory_utilization=cfg["gpu_memory_utilization"], async_scheduling=False,
               tensor_parallel_size=cfg["tensor_parallel_size"], logprobs_mode="processed_logprobs",
               enable_prefix_caching=True, block_size=32 if device == "cpu" else None, **extra)


def take_ticket(store, version, v0, cfg):
    """The staleness bound, one budget for all engines. Batch k is trained at version k, so a group
    admitted at version v is at most max_staleness old when trained iff fewer than (v - v0 +
    max_staleness + 1) * batch_groups were admitted since the run began at v0, not counting
    discarded ones (flat: counted by engines; stale: by the trainer)."""
    allowed = (version - v0 + cfg["max_staleness"] + 1) * cfg["batch_groups"]
    if store.add("admitted", 1) <= allowed + store.add("flat", 0) + store.add("discarded", 0):
        return True
    store.add("admitted", -1)  # over: give it back (another engine may briefly see one too many)
    return False


class Rollout:
    """One engine's loop and its state between two engine steps."""

    def __init__(self, cfg, e):
        import torch
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind as Kind
        self.cfg, self.e, self.parent = cfg, e, os.getppid()
        self.llm = make_llm(cfg, "cuda" if torch.cuda.is_available() else "cpu")
        self.engine, tok = self.llm.llm_engine, self.llm.get_tokenizer()
        train_set, self.eval_set = reward.load_task(cfg)
        for p in train_set + self.eval_set:
            p["ids"] = list(format_prompt(tok, p["prompt"]))
        room = cfg["max_model_len"] - cfg["max_new_tokens"]  # a longer prompt leaves none to answer
        fits = lambda problems: [p for p in problems if len(p["ids"]) <= room]
        self.train_set, self.eval_set = fits(train_set), fits(self.eval_set)
        if not self.train_set:
            raise ValueError("no training prompt fits in max_model_len - max_new_tokens: "
                             "raise max_model_len or lower max_new_tokens")
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.counters["skipped_long"] = len(train_set) - len(self.train_set) if e == 0 else 0
        self.graders = reward.Graders(reward.grader(cfg["task"]), cfg["grader_workers"],
                                      cfg["reward_timeout_s"])
        port, E, tp = cfg["rollout_port"], cfg["rollout_engines"], cfg["tensor_parallel_size"]
        self.store = sync.open_store(port, False, cfg["timeout_s"])
        self.store.set(f"joined{e}", "1")
        self.ctl, self.traj = sync.connect(self.store, 1 + e, E, cfg["timeout_s"])
        self.llm.collective_rpc(sync.join, args=(port, 1 + e * tp, 1 + E * tp, cfg))
        start = json.loads(self.store.get("start"))
        self.v0 = self.version = start["version"]
        self.done, self.first = set(start["done"]), start["next"]
        self.sample = SamplingParams(n=1, temperature=cfg["temperature"], logprobs=0,
                                     max_tokens=cfg["max_new_tokens"], output_kind=Kind.DELTA)
        self.greedy = SamplingParams(n=1, temperature=0.0, max_tokens=cfg["max_new_tokens"],
                                     output_kind=Kind.FINAL_ONLY)
        self.groups, self.evals, self.perm, self.inbox = {}, {}, {}, queue.Queue()
        self.pending, self.retry_at, self.n_groups, self.eval_correct = None, 0.0, 0, 0
        self.idle = ""  # borrow_cpus: our mark in the store (mark_idle)
        threading.Thread(target=self.receive, daemon=True).start()

    def receive(self):  # thread: announced versions into the inbox until -1 (stop) or an error
        try:
            while (v := sync.announced(self.ctl)) >= 0:
                self.inbox.put(v)
            self.inbox.put(v)
        except Exception as e:
            self.inbox.put(e)

    def messages(self):
        """Take what the trainer sent; block briefly only if there is nothing to do. False: stop."""
        block = not self.engine.has_unfinished_requests()
        wait = 0.005 if self.graders.busy else 0.05  # grades due: neither spin nor oversleep
        while True:
            try:
                v = self.inbox.get(block, wait)
            except queue.Empty:
                return True
            if isinstance(v, Exception):
                raise RuntimeError(f"lost the trainer: {v}")
            if v < 0:
                return False
            self.pending, block = v, False

    def add(self, rid, ids, params):  # the salt: no prefix-cache hit on an older version's KV
        self.engine.add_request(rid, {"prompt_token_ids": ids, "cache_salt": f"v{self.version}"},
                                params)

    def post(self, msg):
        self.counters["rollout_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        sync.send_obj(self.traj, {**msg, "engine": self.e, **self.counters}, 0)

    def load(self):  # every vLLM worker receives the new weights itself (sync.load)
        t0 = time.perf_counter()
        self.llm.collective_rpc(sync.load)
        self.llm.reset_prefix_cache()  # a no-op while requests hold blocks: the salt covers that
        self.version, self.pending, self.retry_at = self.pending, None, 0.0
        self.counters["rollout_load_s"] += time.perf_counter() - t0
        every, v = self.cfg["eval_every"], self.version
        if self.e == 0 and every and (v % every == 0 or v == self.cfg["max_steps"]):
            self.start_eval()

    def start_eval(self):  # the next load waits for it: an eval sees one version
        for p in self.eval_set:
            self.evals[rid := f"eval-{self.version}-{p['id']}"] = p
            self.add(rid, p["ids"], self.greedy)

    def admit(self):
        """Start new groups while the shared staleness budget allows. Stream position k (shared by
        the engines) is problem perm[k mod N], perm a seeded shuffle for epoch k // N."""
        if self.evals and self.pending is not None:  # every engine waits in the load for this eval
            return
        n, N = self.cfg["group_size"], len(self.train_set)
        while len(self.groups) < self.cfg["rollout_groups"] and time.monotonic() >= self.retry_at:
            if not take_ticket(self.store, self.version, self.v0, self.cfg):
                self.retry_at = time.monotonic() + 0.01  # the budget grows with a load or a discard
                return
            while (k := self.first + self.store.add("pos", 1) - 1) in self.done:
                pass  # trained before the checkpoint we resumed from
            epoch, i = divmod(k, N)
            if epoch not in self.perm:
                rng = random.Random(f"{self.cfg['seed']}/{epoch}")
                self.perm = {epoch: rng.sample(range(N), N)}
            problem, gid = self.train_set[self.perm[epoch][i]], f"g{self.n_groups}"
            self.n_groups += 1
            self.groups[gid] = {"pos": k, "problem": problem, "left": 2 * n,  # to finish, to grade
                                "comps": [{"ids": [], "logprobs": [], "versions": [], "text": ""}
                                          for _ in range(n)]}
            for i in range(n):
                self.add(f"{gid}/{i}", problem["ids"], self.sample)

    def step(self):
        """One engine step; each new token is tagged with the version loaded now."""
        for out in self.engine.step():
            o, rid = out.outputs[0], out.request_id
            if rid in self.evals:
                if out.finished:
                    self.graders.submit(rid, o.text, self.evals[rid]["answer"])
                continue
            gid, i = rid.rsplit("/", 1)
            g = self.groups[gid]
            c = g["comps"][int(i)]
            c["ids"] += o.token_ids
            c["logprobs"] += [lp[t].logprob for t, lp in zip(o.token_ids, o.logprobs)]
            c["versions"] += [self.version] * len(o.token_ids)
            c["text"] += o.text
            if out.finished:  # to a grader process; the engine steps on meanwhile
                c["cut"] = o.finish_reason == "length"
                self.graders.submit(rid, c["text"], g["problem"]["answer"])
                g["left"] -= 1

    def grades(self):
        """Rewards from the graders; a group whose answers are all graded goes to the trainer."""
        for rid, r, failed in self.graders.poll():
            self.counters["reward_failed"] += failed
            if self.evals.pop(rid, None):
                self.eval_correct += r == 1
                if not self.evals:
                    n = len(self.eval_set)
                    self.post({"kind": "eval", "version": self.version, "eval_n": n,
                               "eval_accuracy": self.eval_correct / n})
                    self.eval_correct = 0
                continue
            gid, i = rid.rsplit("/", 1)
            g = self.groups[gid]
            g["comps"][int(i)]["reward"] = r
            g["left"] -= 1
            if not g["left"]:
                self.send(self.groups.pop(gid))

    def send(self, g):
        from buffer import is_flat
        versions = [v for c in g["comps"] for v in c["versions"] or [self.version]]
        msg = {"kind": "group", "pos": g["pos"], "prompt": g["problem"]["prompt"],
               "prompt_ids": g["problem"]["ids"], "completions": g["comps"],
               "version_min": min(versions), "version_max": max(versions)}
        if self.cfg["drop_flat"] and is_flat(msg):  # the trainer will skip it: replace it now
            self.store.add("flat", 1)
        self.counters["rollout_tokens"] += sum(len(c["ids"]) for c in g["comps"])
        self.mark_idle()  # before the trainer can see this group and look
        self.post(msg)

    def mark_idle(self):
        """borrow_cpus: store key idle{e} = the version this engine waits on with nothing to do
        (at the bound, no request, grade or load), so a lone CPU trainer rank borrows its cores."""
        busy = self.groups or self.evals or self.pending is not None or not self.retry_at
        if (mark := "" if busy else str(self.version)) != self.idle:
            self.store.set(f"idle{self.e}", mark)
            self.idle = mark

    def run(self):
        if self.v0 > 0:  # resumed: the checkpointed weights come before any generation
            while self.pending is None:
                self.messages()
            self.load()
        # the run's first eval, unless the resumed version's load() already started it
        if self.e == 0 and self.cfg["eval_every"] > 0 and not self.evals:
            self.start_eval()
        while self.messages():
            if os.getppid() != self.parent:
                raise RuntimeError("the trainer process is gone")
            if self.pending is not None and not self.evals:
                self.load()
            self.admit()
            self.mark_idle()
            t0 = time.perf_counter()
            if self.engine.has_unfinished_requests():
                self.step()
            t1 = time.perf_counter()
            self.grades()
            self.counters["rollout_engine_s"] += t1 - t0
            self.counters["rollout_grade_s"] += time.perf_counter() - t1
        self.graders.close()
        self.post({"kind": "bye"})


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # torchrun signals rank 0's group; rank 0 stops us
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with trainer rank 0
    config = json.loads(sys.argv[1])
    if config["rollout_cpus"]:  # see place()
        os.sched_setaffinity(0, cpus(config["rollout_cpus"]))
    try:
        Rollout(config, int(sys.argv[2])).run()
    except Exception as e:
        traceback.print_exc()
        print(f"rollout {sys.argv[2]}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        os._exit(1)  # at once: vLLM's threads can hold a normal exit, and the trainer waits on it
