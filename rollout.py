"""rollout.py: one process per vLLM engine, stepped by hand, never waiting for the trainer. Between
two steps it copies in announced weights (received while it generated; requests in flight go on,
each token tagged with the version that computed it), starts groups (budget.py), hands finished
turns to the task's worker processes (reward.py) and sends graded groups to trainer rank 0. A turn
the tool answers goes on as a new request over the dialogue, the tool's tokens included (context,
never trained), up to max_turns. Engine 0 runs the evals too. Simplifications: the engine core runs
in this process (on a GPU vLLM's async scheduling keeps the device busy meanwhile); a group is n=1
requests sharing their prompt's KV cache; no top-k/top-p (the logprobs would be of a truncated
distribution); no speculative decoding."""
import json
import os
import queue
import random
import sys
import threading
import time
import traceback

import numpy as np

import reward
import sync
from budget import Budget

ROOT = os.path.dirname(os.path.abspath(__file__))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # before vllm is imported
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # its CPU warnings repeat by the dozen
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc(sync.load)
COUNTERS = ("reward_failed tool_failures skipped_long rollout_tokens rollout_engine_s "  # summed,
            "rollout_load_s rollout_pause_s rollout_grade_s rollout_steps rollout_running "
            "rollout_started").split()  # sent with every message (pause: the last load's)


def cpus(spec):  # rollout_cpus "1" or "2-3" -> {cores}
    lo, _, hi = spec.partition("-")
    return set(range(int(lo), int(hi or lo) + 1)) if spec else set()


def format_prompt(tok, prompt):  # a user's text, or chat messages
    chat = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    if not tok.chat_template:
        return tok.encode("\n".join(m["content"] for m in chat))
    text = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    return tok.encode(text, add_special_tokens=False)


def make_llm(cfg, device, e=0, **extra):  # engine e, here and in bench.py
    from vllm import LLM
    if device == "cpu":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cfg["kv_cache_gb"]))
    # room, and CUDA graphs, for the training sequences and engine 0's evals
    seqs = cfg["rollout_seqs"] + (cfg["eval_n"] if e == 0 else 0)
    # processed_logprobs: those of the distribution actually sampled. Prefix caching shares whole
    # blocks: at the CPU default of 128 tokens a group's samples would each recompute their prompt
    return LLM(model=cfg["model"], dtype=cfg["rollout_dtype"], seed=cfg["seed"] + e,
               max_model_len=cfg["max_model_len"], enforce_eager=cfg["enforce_eager"],
               gpu_memory_utilization=cfg["gpu_memory_utilization"], max_num_seqs=seqs,
               tensor_parallel_size=cfg["tensor_parallel_size"], logprobs_mode="processed_logprobs",
               enable_prefix_caching=True, block_size=32 if device == "cpu" else None, **extra,
               compilation_config=None if device == "cpu" else {"max_cudagraph_capture_size": seqs})


TOKENS = dict(ids=np.int32, logprobs=np.float32, versions=np.int32, mask=np.int32)  # per token


def completion():  # built turn by turn
    return {**{key: [] for key in TOKENS}, "text": "", "turns": 0}


def extend(c, ids, logprobs, versions, model):  # model: 1 (trained) or 0 (the tool's, context)
    for key, xs in zip(TOKENS, (ids, logprobs, versions, [model] * len(ids))):
        c[key] += xs


def tag(starts, n):  # n tokens' versions, from starts [(version, the first token it computed)]
    return [next(v for v, i in reversed(starts) if i <= t) for t in range(n)]


class Rollout:  # one engine's loop and its state between two engine steps
    def __init__(self, cfg, e):
        import torch
        from vllm.sampling_params import RequestOutputKind, SamplingParams
        self.cfg, self.e = cfg, e
        self.llm = make_llm(cfg, "cuda" if torch.cuda.is_available() else "cpu", e)
        self.engine, self.tok = self.llm.llm_engine, self.llm.get_tokenizer()
        # steps launched but not yet returned by step(): 1 with async scheduling, else 0
        self.lag = self.engine.vllm_config.max_concurrent_batches - 1
        self.task = reward.load_task(cfg)
        room = cfg["max_model_len"] - cfg["max_new_tokens"]  # a longer prompt leaves none to answer
        for p in self.task["train"] + self.task["eval"]:
            p["ids"] = list(format_prompt(self.tok, p["prompt"]))
        self.train_set, self.eval_set = ([p for p in self.task[k] if len(p["ids"]) <= room]
                                         for k in ("train", "eval"))
        if not self.train_set:
            raise ValueError("no training prompt fits in max_model_len - max_new_tokens: "
                             "raise max_model_len or lower max_new_tokens")
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.counters["skipped_long"] = (e == 0) * (len(self.task["train"]) - len(self.train_set))
        self.workers = reward.Workers(cfg["grader_workers"], cfg["reward_timeout_s"])
        self.store = sync.open_store(cfg["host"], cfg["rollout_port"], False, cfg["timeout_s"])
        sync.heartbeat(cfg["host"], cfg["rollout_port"], f"beat{e}", f"rollout process {e}")
        self.store.multi_set([f"idle{e}", f"joined{e}"], ["", "1"])  # idle: mark_idle's key
        self.ctl, self.traj = sync.connect(self.store, 1 + e, cfg["engines"], cfg["timeout_s"])
        self.llm.collective_rpc(sync.join, args=(cfg, 1 + e * cfg["tensor_parallel_size"]))
        start = json.loads(self.store.get("start"))
        self.v0 = self.version = start["version"]
        self.done, self.first = set(start["done"]), start["next"]
        # finished turns only, flat logprobs, undecoded (step() decodes each turn once). A turn
        # that calls the tool ends on any token whose text ends in `stop` if that is one token,
        # else on the text (vLLM then detokenizes every token of such requests)
        stop, ends = self.task["stop"], dict(detokenize=False)
        if stop and len(self.tok.encode(stop, add_special_tokens=False)) == 1:
            ends.update(stop_token_ids=[t for t in range(len(self.tok))
                                        if self.tok.decode([t]).endswith(stop)])
        elif stop:
            ends = dict(stop=stop, detokenize=True, include_stop_str_in_output=True)
        self.params = lambda greedy, room: SamplingParams(
            temperature=0.0 if greedy else cfg["temperature"], max_tokens=room, n=1, logprobs=0,
            flat_logprobs=True, output_kind=RequestOutputKind.FINAL_ONLY, **ends)
        self.groups, self.perm, self.inbox = {}, {}, queue.Queue()  # by id: g{pos}; evals: eval{v}
        self.starts = {}  # request id -> [(version, index of the first token it computed)]
        self.pending, self.live, self.running = None, 0, 0
        self.budget = Budget(self.store, cfg, e, self.v0)
        self.idle = ""  # borrow_cpus: our mark in the store (mark_idle)
        threading.Thread(target=self.receive, daemon=True).start()

    def receive(self):  # thread: announced versions into the inbox until -1 (stop) or an error
        try:
            while (v := sync.announce(self.ctl)) >= 0:
                self.inbox.put(v)
            self.inbox.put(v)
        except Exception as e:
            self.inbox.put(e)

    def messages(self):  # what the trainer sent; idle, wait briefly for it or a worker. False: stop
        block = not self.engine.has_unfinished_requests()
        if block and self.workers.busy:
            self.workers.wait(0.05)  # wakes at the first result
            block = False
        while True:
            try:
                v = self.inbox.get(block, 0.05)
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
        self.starts[rid] = [(self.version, 0)]
        self.running += not rid.startswith("eval")  # training sequences in vLLM

    def post(self, msg):
        self.counters["rollout_started"] = self.budget.started  # groups, before any given back
        sync.send_obj(self.traj, {**msg, "engine": self.e, **self.counters}, 0)

    def load(self):
        """Every vLLM worker copies in the weights it received while we generated (sync.load): a
        request's tokens from here on are theirs, but `lag` of a step launched before (old)."""
        t0 = time.perf_counter()
        self.version = self.llm.collective_rpc(sync.load)[0]  # the oldest push received
        self.pending = None if self.version == self.pending else self.pending
        for r in self.engine.output_processor.request_states.values():  # requests in flight
            self.starts[r.external_req_id].append(
                (self.version, r.detokenizer.num_output_tokens() + self.lag))
        self.counters["rollout_pause_s"] = time.perf_counter() - t0  # generation paused
        self.counters["rollout_load_s"] += self.counters["rollout_pause_s"]
        self.evaluate()

    def evaluate(self, first=False):  # engine 0: a held-out eval beside the training groups
        v, every = self.version, self.cfg["eval_every"]
        if self.e == 0 and every and (first or v % every == 0 or v == self.cfg["max_steps"]):
            self.open(f"eval{v}", self.eval_set, True, version=v)

    def open(self, gid, problems, greedy, **group):  # a request per problem, to grade all
        self.groups[gid] = {"problems": problems, "comps": [completion() for _ in problems],
                            "left": len(problems), **group}
        params = self.params(greedy, self.cfg["max_new_tokens"])
        for j, p in enumerate(problems):
            self.add(f"{gid}/{j}/0", p["ids"], params)

    def admit(self):
        """New groups as the budget and the free slots allow (budget.py), positions in one round
        trip. Stream position k (shared by all engines) is problem perm[k mod N], seeded."""
        got, N, positions = self.budget.take(self.version, self.live), len(self.train_set), []
        while len(positions) < got:  # skip those trained before the checkpoint we resumed from
            n = got - len(positions)
            end = self.first + self.store.add("pos", n)
            positions += [k for k in range(end - n, end) if k not in self.done]
        for k in positions:
            epoch, i = divmod(k, N)
            if epoch not in self.perm:  # the epoch's order, the same in every engine
                rng = random.Random(f"{self.cfg['seed']}/{epoch}")
                self.perm = {epoch: rng.sample(range(N), N)}
            problem = self.train_set[self.perm[epoch][i]]  # its group's id: g{k}, k unique
            self.open(f"g{k}", [problem] * self.cfg["group_size"], False, pos=k)
            self.live += self.cfg["group_size"]  # sequences generating, or in a tool call

    def step(self):  # one engine step; each turn it finished goes to the task's turn or grade
        self.counters["rollout_steps"] += 1
        self.counters["rollout_running"] += self.running / self.cfg["rollout_seqs"]
        for out in self.engine.step():  # finished requests only
            o, rid, (gid, i, _) = out.outputs[0], out.request_id, out.request_id.split("/")
            c, n = self.groups[gid]["comps"][int(i)], len(o.token_ids)
            extend(c, o.token_ids, o.logprobs.logprobs, tag(self.starts.pop(rid), n), 1)
            c["text"] += o.text or self.tok.decode(o.token_ids, skip_special_tokens=True)
            c["turns"], c["cut"] = c["turns"] + 1, o.finish_reason == "length"
            self.running -= not gid.startswith("eval")
            final = c["cut"] or c["turns"] >= self.cfg["max_turns"] or not self.task["turn"]
            self.submit(gid, int(i), "grade" if final else "turn")

    def submit(self, gid, i, fn):  # to the task's "turn" (its tool) or "grade" (final: a free slot)
        g = self.groups[gid]
        self.live -= fn == "grade" and not gid.startswith("eval")
        self.workers.submit((gid, i, fn), self.task[fn], g["comps"][i]["text"],
                            g["problems"][i]["answer"])

    def grades(self):  # the workers' results: a tool's words go on; graded groups go to the trainer
        for (gid, i, fn), result, failed in self.workers.poll():
            g = self.groups[gid]
            if fn == "turn":  # the tool's words; None: the answer is final; a failure ends it
                self.counters["tool_failures"] += failed
                if not (isinstance(result, str) and self.go_on(gid, i, result)):
                    self.submit(gid, i, "grade")
                continue
            ok = isinstance(result, float)  # else it failed, or returned no number
            self.counters["reward_failed"] += not ok
            g["comps"][i]["reward"] = result if ok else 0.0
            g["left"] -= 1
            if not g["left"]:
                self.send(self.groups.pop(gid))

    def go_on(self, gid, i, words):
        """The tool's tokens, then the next turn: a new request over the whole dialogue (prefix
        caching keeps it cheap). -> False if the words leave no room for it (the answer is cut)."""
        g, env = self.groups[gid], self.tok.encode(words, add_special_tokens=False)
        c = g["comps"][i]
        room = self.cfg["max_new_tokens"] - len(c["ids"]) - len(env)
        if room <= 0:
            c["cut"] = True
            return False
        extend(c, env, [0.0] * len(env), [self.version] * len(env), 0)
        c["text"] += words
        self.add(f"{gid}/{i}/{c['turns']}", g["problems"][i]["ids"] + c["ids"],
                 self.params("version" in g, room))
        return True

    def send(self, g):
        versions = [v for c in g["comps"] for v in c["versions"] or [self.version]]
        if "version" in g:  # an eval: the weights its tokens came from span these versions
            n = len(g["comps"])
            return self.post({"kind": "eval", "version": g["version"], "eval_n": n,
                              "eval_accuracy": sum(c["reward"] == 1 for c in g["comps"]) / n,
                              "eval_versions": [min(versions), max(versions)]})
        problem = g["problems"][0]
        msg = {"kind": "group", "pos": g["pos"], "prompt": problem["prompt"], "prompt_ids":
               problem["ids"], "completions": g["comps"], "version_min": min(versions)}
        if self.cfg["drop_flat"] and reward.is_flat(msg):  # the trainer skips it: replace it now
            self.budget.returned += 1
        self.counters["rollout_tokens"] += sum(sum(c["mask"]) for c in g["comps"])  # generated
        for c in g["comps"]:  # arrays: rank 0 unpickles 4 objects, not 4 a token; fp32 is vLLM's
            c.update({key: np.array(c[key], dtype) for key, dtype in TOKENS.items()})
        self.mark_idle()  # before the trainer can see this group and look
        self.post(msg)

    def mark_idle(self):  # borrow_cpus: idle{e} = the version we wait on, with nothing to do
        busy = self.groups or self.pending is not None  # admit() ran just before
        if (mark := "" if busy else str(self.version)) != self.idle:
            self.store.set(f"idle{self.e}", mark)
            self.idle = mark

    def run(self):
        if self.v0 > 0:  # resumed: the checkpointed weights come before any generation
            while self.pending is None:
                self.messages()
            self.load()
        if f"eval{self.version}" not in self.groups:  # the run's first, unless load() started it
            self.evaluate(first=True)
        while self.messages():  # a dead trainer kills us (reward.die_with_parent)
            if self.pending is not None:  # never waits for an eval
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
        self.workers.close()
        self.post({"kind": "bye"})


if __name__ == "__main__":
    reward.die_with_parent()  # trainer rank 0: it stops us at its step boundary, or dies
    config = json.loads(sys.argv[1])
    if config["rollout_cpus"]:  # see place()
        os.sched_setaffinity(0, cpus(config["rollout_cpus"]))
    try:
        Rollout(config, int(sys.argv[2])).run()
    except Exception:
        traceback.print_exc()
        os._exit(1)  # at once: vLLM's threads can hold a normal exit, and the trainer waits on it
    os._exit(0)
