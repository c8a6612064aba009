"""rollout.py: a process per vLLM engine, stepped by hand, never waiting on the trainer: between
steps it loads weights, opens groups (budget.py), hands turns to workers (reward.py), sends graded
groups to rank 0. Simplifications: engine core in-process; n=1 requests; no top-k/p, no spec.

Runs in its own process, one per engine (fleet.spawn starts it from each node's first rank), with
vLLM's engine core and workers inside it. Graders (reward.Workers) and environments (env.Envs)
run in processes of their own, so a slow or hung one never stalls this loop: the loop hands
them text and picks up what has come back, once per engine step."""
import json, os, queue, random, sys, threading, time, traceback, types

import numpy as np

import budget, env, lora, reward, sync

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # before importing vllm
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # its CPU warnings repeat
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc(sync.load)
COUNTERS = ("reward_failed env_errors env_timeouts skipped_long rollout_tokens rollout_engine_s "
            "rollout_load_s rollout_pause_s rollout_grade_s rollout_steps rollout_running "
            "rollout_started").split()

# ---- what an engine sends the trainer ----
TOKENS = dict(ids=np.int32, logprobs=np.float32, versions=np.int32, mask=np.int32)  # per token


def completion():  # an answer, turn by turn
    # TOKENS' lists: ids (model and tool tokens), logprobs (of the sampled distribution; tool's: 0),
    # versions (policy version that made each), mask (1: model's, trained; 0: tool's); text (the
    # environment's words too), turns (model turns: replies + 1), cut (hit max_new_tokens), reward
    # (the grade, or the sum of the environment's rewards)
    return {**{key: [] for key in TOKENS}, "text": "", "turns": 0, "cut": False, "reward": 0.0}


def extend(c, ids, logprobs, versions, model):
    for key, xs in zip(TOKENS, (ids, logprobs, versions, [model] * len(ids))):
        c[key] += xs


def token_versions(spans, n):  # spans in load order
    versions = np.empty(n, np.int32)
    for version, first in spans:  # a load takes over from its first token
        versions[first:] = version
    return versions.tolist()


# ---- the engine ----
def format_prompt(tok, prompt):  # text or chat messages -> token ids
    chat = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    if not tok.chat_template:
        return tok.encode("\n".join(m["content"] for m in chat))
    text = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    return tok.encode(text, add_special_tokens=False)


def make_llm(cfg, device, e=0):  # engine e (peers/ too)
    from vllm import LLM
    if device == "cpu":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cfg["kv_cache_gb"]))
    seqs = cfg["rollout_seqs"] + (cfg["eval_n"] if e == 0 else 0)  # engine 0's evals too
    # fp32 head as in training; prefix caching shares whole blocks (CPU's 128: none)
    return LLM(model=cfg["model"], dtype=cfg["rollout_dtype"], seed=cfg["seed"] + e,
               max_model_len=cfg["max_model_len"], enforce_eager=cfg["enforce_eager"],
               gpu_memory_utilization=cfg["gpu_memory_utilization"], max_num_seqs=seqs,
               tensor_parallel_size=cfg["tensor_parallel_size"], logprobs_mode="processed_logprobs",
               hf_overrides={"head_dtype": "float32"}, enable_prefix_caching=True,
               block_size=32 if device == "cpu" else None, **lora.engine_args(cfg, device),
               compilation_config=None if device == "cpu" else {"max_cudagraph_capture_size": seqs})


def user_turn(tok):
    """An environment's reply to a chat model comes as the template's user turn: (the text before
    it, after it), following the model's end of turn; None without a template. Rendered once, so
    earlier turns are never templated again: the trainer sees the tokens the engine saw."""
    if not tok.chat_template:
        return None
    chat = [{"role": role, "content": f"NANOASYNC_{role}"} for role in ("user", "assistant")]
    chat.append({"role": "user", "content": "NANOASYNC_reply"})
    full = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    after_answer = full[full.index("NANOASYNC_assistant") + len("NANOASYNC_assistant"):]
    return tuple(after_answer.split("NANOASYNC_reply"))


def stop_settings(tok, stop):
    """A tool call ends a turn: one token by the ids ending in it (no detokenizing), or text."""
    if not stop:
        return dict(detokenize=False)
    if len(tok.encode(stop, add_special_tokens=False)) == 1:
        ids = [t for t in range(len(tok)) if tok.decode([t]).endswith(stop)]
        return dict(detokenize=False, stop_token_ids=ids)
    return dict(stop=stop, detokenize=True, include_stop_str_in_output=True)


class Rollout:
    def __init__(self, cfg, e):
        self.cfg, self.e = cfg, e
        self.start_engine()
        self.load_prompts()
        self.connect()
        self.groups = {}  # open: g{pos}, eval{version}
        self.spans = {}  # request id -> [(version, first token)]
        self.pending = None  # announced, not yet loaded
        self.holding = 0  # slots our training sequences hold (vLLM or tool)
        self.perm = {}  # epoch -> its prompts' order
        self.idle = ""  # our mark in the store
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.counters["skipped_long"] = self.skipped if e == 0 else 0
        self.budget = budget.Budget(self.store, cfg, e, self.v0)
        self.inbox = queue.Queue()
        threading.Thread(target=self.receive, daemon=True).start()

    def start_engine(self):
        import torch
        from vllm.sampling_params import RequestOutputKind, SamplingParams
        self.llm = make_llm(self.cfg, "cuda" if torch.cuda.is_available() else "cpu", self.e)
        self.engine, self.tok = self.llm.llm_engine, self.llm.get_tokenizer()
        self.adapter = lora.request(self.cfg)  # None: no LoRA
        self.lag = self.engine.vllm_config.max_concurrent_batches - 1  # launched, not returned
        self.task = reward.load_task(self.cfg)
        self.user_turn = user_turn(self.tok)
        self.faults = {}  # env fault kind -> first message, shown once
        self.answers = [0, 0]  # ended, of them failed: a broken environment fails fast
        timeout = self.cfg["reward_timeout_s"]  # its processes, or the graders' (each warmed up
        first = self.task["train"][0]["answer"]  # on the first problem's answer)
        self.workers = (env.Envs(self.task["env"], timeout) if self.task["env"] else reward.Workers(
            self.cfg["grader_workers"], timeout, self.task["grade"], first))
        ends = stop_settings(self.tok, self.task["stop"])
        self.params = lambda greedy, room: SamplingParams(  # finished turns only
            temperature=0.0 if greedy else self.cfg["temperature"], max_tokens=room, n=1,
            logprobs=0, flat_logprobs=True, output_kind=RequestOutputKind.FINAL_ONLY, **ends)

    def load_prompts(self):  # skips those with no room to answer
        room = self.cfg["max_model_len"] - self.cfg["max_new_tokens"]
        for p in self.task["train"] + self.task["eval"]:  # an environment's: at reset()
            p["ids"] = [] if self.task["env"] else list(format_prompt(self.tok, p["prompt"]))
        self.train_set = [p for p in self.task["train"] if len(p["ids"]) <= room]
        self.eval_set = [p for p in self.task["eval"] if len(p["ids"]) <= room]
        self.skipped = len(self.task["train"]) - len(self.train_set)
        if not self.train_set:
            raise ValueError("no training prompt fits in max_model_len - max_new_tokens: "
                             "raise max_model_len or lower max_new_tokens")

    def connect(self):
        cfg, e = self.cfg, self.e
        self.store = sync.open_store(cfg["host"], cfg["rollout_port"], False, cfg["timeout_s"])
        self.heartbeat = sync.Heartbeat(cfg["host"], cfg["rollout_port"], f"beat{e}")
        self.store.multi_set([f"idle{e}", f"joined{e}"], ["", "1"])
        self.ctl, self.traj = sync.connect(self.store, 1 + e, cfg["engines"], cfg["timeout_s"])
        self.llm.collective_rpc(sync.join, args=(cfg, e))
        start = json.loads(self.store.get("start"))
        self.v0 = self.version = start["version"]
        self.done, self.first = set(start["done"]), start["next"]  # the stream, resumed
        self.store.wait([f"joined{f}" for f in range(cfg["engines"])])  # a fair start

    def run(self):
        if self.v0 > 0:  # resumed: checkpointed weights first
            while self.pending is None:
                self.poll_trainer()
            self.load()
        if f"eval{self.version}" not in self.groups:  # unless load() ran it
            self.evaluate(first=True)
        while self.poll_trainer():  # a dead trainer kills us (die_with_parent)
            self.heartbeat.moved()
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
        self.heartbeat.stop()  # "bye": the trainer's watchers let us go
        self.send({"kind": "bye"})

    # ---- trainer's side: versions, loads, evals ----
    def receive(self):  # a thread: announced versions -> inbox
        try:
            while (v := sync.broadcast_version(self.ctl)) >= 0:
                self.inbox.put(v)
            self.inbox.put(v)
        except Exception as e:
            self.inbox.put(e)

    def poll_trainer(self):  # False: stop
        block = not self.engine.has_unfinished_requests()
        if block and self.workers.running:
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
            self.pending = v
            block = False

    def load(self):  # workers load the weights (sync.load); tokens `lag` steps on are theirs
        t0 = time.perf_counter()
        self.version = self.llm.collective_rpc(sync.load)[0]
        if self.pending is not None and self.pending <= self.version:  # (paused: maybe newer)
            self.pending = None
        for r in self.engine.output_processor.request_states.values():
            first = r.detokenizer.num_output_tokens() + self.lag
            self.spans[r.external_req_id].append((self.version, first))
        self.counters["rollout_pause_s"] = time.perf_counter() - t0  # generation paused
        self.counters["rollout_load_s"] += self.counters["rollout_pause_s"]
        self.evaluate()

    def evaluate(self, first=False):  # a held-out eval
        v, every = self.version, self.cfg["eval_every"]
        if self.e == 0 and every and (first or v % every == 0 or v == self.cfg["max_steps"]):
            self.open(f"eval{v}", self.eval_set, greedy=True, version=v)

    def mark_idle(self):  # borrow_cpus: idle{e} = version we wait for
        # busy: admit() ran just before
        mark = "" if self.groups or self.pending is not None else str(self.version)
        if mark != self.idle:
            self.store.set(f"idle{self.e}", mark)
            self.idle = mark

    # ---- a group's life: admitted, stepped, graded, sent ----
    def admit(self):  # groups the budget allows: stream position k is problem perm[k mod N]
        n_new = self.budget.take(self.version, self.holding)
        N = len(self.train_set)
        positions = []
        while len(positions) < n_new:  # not those trained before a checkpoint
            n = n_new - len(positions)
            end = self.first + self.store.add("pos", n)
            positions += [k for k in range(end - n, end) if k not in self.done]
        for k in positions:
            epoch, i = divmod(k, N)
            if epoch not in self.perm:  # same in every engine
                rng = random.Random(f"{self.cfg['seed']}/{epoch}")
                self.perm = {epoch: rng.sample(range(N), N)}
            problem = self.train_set[self.perm[epoch][i]]
            self.open(f"g{k}", [problem] * self.cfg["group_size"], greedy=False, pos=k)
            self.holding += self.cfg["group_size"]

    def open(self, gid, problems, greedy, **group):
        n = len(problems)
        self.groups[gid] = {"problems": problems, "comps": [completion() for _ in problems],
                            "prompts": [None] * n, "left": n, "eval": greedy, **group}
        for i, p in enumerate(problems):
            if self.task["env"]:  # its own environment; the prompt comes back from reset()
                self.workers.start((gid, i), p["answer"])
            else:
                self.begin(gid, i, p["prompt"], p["ids"])

    def begin(self, gid, i, prompt, ids):  # an answer's first turn
        g = self.groups[gid]
        if len(ids) > self.cfg["max_model_len"] - self.cfg["max_new_tokens"]:
            raise ValueError(f"{self.cfg['task']}: a prompt of {len(ids)} tokens leaves no room "
                             "in max_model_len - max_new_tokens: raise max_model_len")
        g["prompts"][i] = (prompt, ids)
        self.add(gid, i, ids, self.params(g["eval"], self.cfg["max_new_tokens"]))

    def add(self, gid, i, ids, params):  # the salt: no prefix-cache hit on older weights
        rid = f"{gid}/{i}/{self.groups[gid]['comps'][i]['turns']}"  # group/completion/turn
        prompt = {"prompt_token_ids": ids, "cache_salt": f"v{self.version}"}
        self.engine.add_request(rid, prompt, params, lora_request=self.adapter)
        self.spans[rid] = [(self.version, 0)]

    def step(self):
        self.counters["rollout_steps"] += 1
        in_vllm = sum(rid.startswith("g") for rid in self.spans)  # training requests (g{pos}/...)
        self.counters["rollout_running"] += in_vllm / self.cfg["rollout_seqs"]
        for out in self.engine.step():  # finished requests only
            gid, i, _turn = out.request_id.split("/")
            g, o, i = self.groups[gid], out.outputs[0], int(i)
            c, spans = g["comps"][i], self.spans.pop(out.request_id)
            extend(c, o.token_ids, o.logprobs.logprobs, token_versions(spans, len(o.token_ids)), 1)
            said = o.text or self.tok.decode(o.token_ids, skip_special_tokens=True)
            c["text"] += said
            c["turns"] += 1
            c["cut"] = o.finish_reason == "length"
            if self.task["env"]:  # the whole turn, to its environment (the slot stays held)
                self.workers.call((gid, i), said)
            else:  # its last turn: the slot is free as it is graded
                self.holding -= not g["eval"]
                self.workers.submit((gid, i), self.task["grade"], c["text"],
                                    g["problems"][i]["answer"])

    def grades(self):  # graders' and environments' replies
        for (gid, i), value, fault in self.workers.poll():
            g, c = self.groups[gid], self.groups[gid]["comps"][i]
            if not self.task["env"]:  # a grade (a float), unless it failed
                self.counters["reward_failed"] += fault
                c["reward"] = 0.0 if fault else value
            elif fault:  # a raise, a hang, a wrong shape: this answer alone ends, at 0
                c["reward"] = 0.0
                self.counters[f"env_{fault}s"] += 1  # counted; the first of each kind shown
                if fault not in self.faults:
                    self.faults[fault] = value
                    print(f"{self.cfg['task']}: an environment call failed ({fault}; counted in "
                          f"env_{fault}s, only the first is shown):\n{value}", file=sys.stderr)
            elif g["prompts"][i] is None:  # reset()'s prompt: the first turn
                self.begin(gid, i, value, format_prompt(self.tok, value))
                continue
            else:
                words, r, done = value
                c["reward"] += r
                if not (done or c["cut"] or c["turns"] >= self.cfg["max_turns"]):
                    if self.go_on(gid, i, words):
                        continue
                self.workers.end((gid, i))
            self.end_answer(gid, g, fault)

    def end_answer(self, gid, g, failed):
        if self.task["env"]:  # its slot is free (a graded answer's was at submit)
            self.holding -= not g["eval"]
        self.answers[0] += 1
        self.answers[1] += bool(failed)
        first = 2 * self.cfg["group_size"]
        if self.task["env"] and self.answers == [first, first]:
            raise ValueError(f"{self.cfg['task']}: the first {first} answers all failed, the "
                             f"environment is broken:\n{next(iter(self.faults.values()))}")
        g["left"] -= 1
        if not g["left"]:
            self.finish_group(self.groups.pop(gid))

    def go_on(self, gid, i, words):  # the reply's tokens, then the next turn; False: no room
        g, c = self.groups[gid], self.groups[gid]["comps"][i]
        stop = self.task["stop"]
        if self.user_turn and not (stop and c["text"].endswith(stop)):  # as the user's turn
            before, after = self.user_turn  # less the model's end of turn, already its token
            words = before.removeprefix(self.tok.decode(c["ids"][-1:])) + words + after
        reply = self.tok.encode(words, add_special_tokens=False)
        room = self.cfg["max_new_tokens"] - len(c["ids"]) - len(reply)
        if room <= 0:
            c["cut"] = True
            return False
        extend(c, reply, [0.0] * len(reply), [self.version] * len(reply), 0)
        c["text"] += words
        self.add(gid, i, g["prompts"][i][1] + c["ids"], self.params(g["eval"], room))
        return True

    def finish_group(self, g):  # an eval's accuracy, or a group to train
        comps = g["comps"]
        versions = [v for c in comps for v in c["versions"] or [self.version]]
        if g["eval"]:  # its tokens span these versions; an environment's success: reward > 0
            won = [c["reward"] > 0 if self.task["env"] else c["reward"] == 1 for c in comps]
            return self.send({"kind": "eval", "version": g["version"], "eval_n": len(comps),
                              "eval_accuracy": sum(won) / len(comps),
                              "eval_versions": [min(versions), max(versions)]})
        if not all(c["ids"] for c in comps):  # a reset() failed: no answer to compare with
            return self.budget.give_back()
        prompts = {tuple(ids) for _, ids in g["prompts"]}
        if len(prompts) > 1:
            raise ValueError(f"{self.cfg['task']}: reset() gave the {len(comps)} answers of seed "
                             f"{g['problems'][0]['answer']} {len(prompts)} prompts; a group "
                             "shares one: make the prompt depend on the seed alone")
        prompt, ids = g["prompts"][0]
        # the record that travels to rank 0, read by buffer.py, loss.py, metrics.py and train.py
        msg = {"kind": "group",  # (or "eval", "bye")
               "pos": g["pos"],  # its place in the shared stream: its id
               "prompt": prompt,  # as the task gave it
               "prompt_ids": ids,  # chat template applied
               "completions": comps,  # group_size of completion()
               "version_min": min(versions)}  # its staleness when trained
        if self.task["env"]:
            msg["seed"] = g["problems"][0]["answer"]
        if self.cfg["drop_flat"] and reward.is_flat(msg):  # skipped: start another
            self.budget.give_back()
        self.counters["rollout_tokens"] += sum(sum(c["mask"]) for c in comps)  # generated
        for c in comps:  # rank 0 unpickles 4 arrays, not 4 objects a token
            c.update({key: np.array(c[key], dtype) for key, dtype in TOKENS.items()})
        self.mark_idle()  # before the trainer sees this group
        self.send(msg)

    def send(self, msg):
        self.counters["rollout_started"] = self.budget.started  # before any given back
        sync.send_obj(self.traj, {**msg, "engine": self.e, "stats": dict(self.counters)}, 0)


if __name__ == "__main__":
    # multiprocessing's children (graders, environments) import the main module again, unless
    # it has none: they need nothing of this file, and it would cost each an import of torch
    sys.modules["__main__"] = types.ModuleType("__main__")
    reward.die_with_parent()  # rank 0 stops us between steps, or dies
    config = json.loads(sys.argv[1])
    if config["cores"]:  # rollout_cpus: see fleet.place()
        os.sched_setaffinity(0, config["cores"])
    try:
        Rollout(config, int(sys.argv[2])).run()
    except ValueError as e:  # a config that can't work: one line
        print(f"error: rollout process {sys.argv[2]}: {e}", file=sys.stderr)
        os._exit(2)
    except Exception:
        traceback.print_exc()
        os._exit(1)  # at once: vLLM's threads can stall an exit
    os._exit(0)
