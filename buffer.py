"""buffer.py: the trainer's end of the rollout side. place() and spawn() start each node's engines;
on rank 0 Rollouts puts the groups they send in a Buffer, from which the trainer takes batches,
dropping stale groups (the engines admit replacements) and optionally flat ones (already replaced).
Simplifications: first in, first out; no priority, no replay, no memory cap beyond admission."""
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter

import rollout
import sync
from configurator import die
from reward import is_flat

TORCHRUN_ENV = ("RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT GROUP_RANK "
                "ROLE_RANK ROLE_WORLD_SIZE GROUP_WORLD_SIZE OMP_NUM_THREADS").split()


class Stopped(Exception):
    """Ctrl-C, SIGTERM (torchrun passes both to all ranks) or a stall: stop at the step boundary."""


class Buffer:
    def __init__(self, max_staleness, drop_flat, on_discard=lambda group: None, stall_s=0):
        self.max_staleness, self.drop_flat, self.on_discard = max_staleness, drop_flat, on_discard
        self.stall_s = stall_s  # > 0: waiting this long with nothing usable stops the run
        self.groups, self.cond, self.dropped = [], threading.Condition(), {"stale": 0, "flat": 0}

    def put(self, group):  # a group, or the exception that ended its producer (get() raises it)
        with self.cond:
            self.groups.append(group)
            self.cond.notify()

    def get(self, version, n_groups, check_alive=lambda: None, report=lambda text, groups: None):
        """-> (n_groups usable groups, all taken out, seconds waited); check_alive() each second,
        report() each min(60, stall_s / 3) s waited, with the groups dropped since a usable one."""
        check_alive()
        batch, seen, dropped, reported = [], [], [], 0  # reported: dropped groups reported
        start = told = usable = time.perf_counter()  # usable: when the last usable group came
        while len(batch) < n_groups:
            with self.cond:
                while not self.groups:
                    self.cond.wait(timeout=1.0)
                    check_alive()
                    if (now := time.perf_counter()) - told > min(60, self.stall_s / 3 or 60):
                        report(f"waiting {now - start:.0f} s for batch {version} ({len(batch)}/"
                               f"{n_groups} groups), {describe(dropped)}", dropped[reported:])
                        told, reported = now, len(dropped)
                    if self.stall_s and now - usable > self.stall_s:
                        raise Stopped(f"nothing usable came in stall_s={self.stall_s} s "
                                      f"({describe(dropped)}); try an easier task or a "
                                      "stronger model, --drop_flat=False, or check that the "
                                      "grader reads the answers in samples.jsonl")
                if isinstance(g := self.groups.pop(0), Exception):
                    raise g
                seen.append(g)
            flat = self.drop_flat and is_flat(g)
            why = "stale" if version - g["version_min"] > self.max_staleness else flat and "flat"
            if why == "stale" and not flat:  # a flat one's engine replaced it already
                self.on_discard(g)
            if why:
                self.dropped[why] += 1
                dropped.append(dict(g, dropped=why))
            else:
                batch.append(g)
                dropped, reported, usable = [], 0, time.perf_counter()
        return batch, seen, time.perf_counter() - start


def describe(dropped):  # -> "3 groups dropped since ...: 2 flat at reward 0, 1 stale"
    kinds = Counter(f"flat at reward {g['completions'][0]['reward']:g}" if g["dropped"] == "flat"
                    else g["dropped"] for g in dropped)
    return (f"{len(dropped)} groups dropped since the last usable one" + ": " * bool(dropped)
            + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())))


def deal(groups, world_size):
    """-> the groups of each rank r: r, r + W, r + 2W, ... Flat ones (no gradient) only as filler:
    FSDP needs as many forwards on every rank."""
    live, flat = [g for g in groups if not is_flat(g)], [g for g in groups if is_flat(g)]
    n = max(1, -(-len(live) // world_size)) * world_size  # groups to run, a multiple of W
    return [(live + flat[:n - len(live)])[r::world_size] for r in range(world_size)]


def place(cfg, world, local_world, device, leader):
    """-> (this node's engines' GPUs, after its trainer ranks; cores a lone CPU rank may borrow)."""
    import torch
    E, tp = cfg["rollout_engines"], cfg["tensor_parallel_size"]
    if device.type == "cpu":
        cores = rollout.cpus(cfg["rollout_cpus"])  # vLLM's cores, as a GPU of its own would be
        borrow = len(cores) if cfg["borrow_cpus"] and world == 1 else 0  # borrow_cpus
        ours = os.sched_getaffinity(0) - cores
        if cores and not borrow:
            os.sched_setaffinity(0, ours)
        # a thread per core of ours (torchrun sets OMP_NUM_THREADS for several ranks only, and
        # OpenMP's default, every core, would put a spinning thread on vLLM's)
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or
                                  max(1, len(ours) // local_world)))
        return [[] for _ in range(E)] if leader else [], borrow
    torch.cuda.set_device(device)
    gpus = os.environ.get("CUDA_VISIBLE_DEVICES") or ",".join(
        map(str, range(torch.cuda.device_count())))
    gpus, first = gpus.split(","), 0 if cfg["colocate"] else local_world
    if leader and cfg["colocate"] and world * E * tp != 1:  # CUDA IPC: one device
        die("colocate runs 1 trainer rank and 1 engine with tensor_parallel_size=1 on one GPU: "
            "--nproc_per_node=1 --rollout_engines=1 --tensor_parallel_size=1, or no --colocate")
    if leader and first + E * tp > len(gpus):
        die(f"{local_world} trainer ranks + {E} engines x tensor_parallel_size={tp} need more than "
            f"the {len(gpus)} GPUs of this node: fewer trainer ranks or --rollout_engines, or "
            "--colocate")
    return [gpus[first + e * tp:first + (e + 1) * tp] for e in range(E)] if leader else [], 0


def spawn(cfg, engine_gpus, first, engines, host):
    """This node's engines, numbered first, first + 1, ..., as processes (not torchrun ranks)."""
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV and "TORCHELASTIC" not in k}
    env.update(PYTHONPATH=rollout.ROOT + os.pathsep + env.get("PYTHONPATH", ""),  # workers: sync
               VLLM_ENABLE_V1_MULTIPROCESSING="0")  # the engine core in-process: rollout.tag()
    if spec := cfg["rollout_cpus"]:
        env.update(VLLM_CPU_OMP_THREADS_BIND=spec, OMP_NUM_THREADS=str(len(rollout.cpus(spec))))
    if cfg["rollout_dtype"] == "float32":  # a GPU's Triton attention: IEEE fp32, not TF32
        env.setdefault("TRITON_F32_DEFAULT", "ieee")
    cfg = json.dumps(dict(cfg, engines=engines, host=host))
    return [subprocess.Popen([sys.executable, f"{rollout.ROOT}/rollout.py", cfg, str(first + e)],
                             env=dict(env, CUDA_VISIBLE_DEVICES=",".join(gpus)) if gpus else env)
            for e, gpus in enumerate(engine_gpus)]


class Rollouts:
    """Trainer rank 0's end of the rollout processes of every node; other ranks only join push."""

    def __init__(self, cfg, plan, device, engine_gpus, ckpt, stop_requested, nodes=1):
        self.engines, timeout = cfg["rollout_engines"] * nodes, cfg["timeout_s"]
        self.per_node, self.beats = cfg["rollout_engines"], {}
        self.stop_requested, self.evals, self.stats, self.last = stop_requested, [], {}, {}
        self.done, self.next = set(ckpt.get("done", [])), ckpt.get("next", 0)  # positions taken
        self.procs, host = [], os.environ.get("MASTER_ADDR", "127.0.0.1")
        try:  # port taken, or a rollout process died starting
            self.store = sync.open_store(host, cfg["rollout_port"], True, timeout)
            self.store.set("start", json.dumps({"version": ckpt.get("version", 0),
                                                "next": self.next, "done": sorted(self.done)}))
            self.procs = spawn(cfg, engine_gpus, 0, self.engines, host)
            if not self.wait(lambda: self.store.check([f"joined{e}" for e in range(self.engines)]),
                             cfg["start_timeout_s"]):
                raise TimeoutError(f"the engines did not start in start_timeout_s="
                                   f"{cfg['start_timeout_s']} s")
        except (RuntimeError, TimeoutError) as e:
            kill(self.procs)
            die(str(e))
        self.beats = {e: (None, time.monotonic()) for e in range(self.engines)}  # all beating
        self.ctl, trajs = sync.connect(self.store, 0, self.engines, timeout)
        self.sender = sync.Sender(self.store, plan, cfg, device,
                                  self.engines * cfg["tensor_parallel_size"])
        # a stale group's ticket back to its engine (budget.py): it may start a replacement
        discard = lambda g: self.store.add(f"discarded{g['engine']}", 1)
        self.buffer = Buffer(cfg["max_staleness"], cfg["drop_flat"], discard, cfg["stall_s"])
        self.buffer.dropped = dict(zip(("stale", "flat"), ckpt.get("dropped", [0, 0])))
        self.receivers = [threading.Thread(target=self.receive, args=(t,), daemon=True)
                          for t in trajs]
        for r in self.receivers:
            r.start()

    def check_alive(self, stoppable=True):
        """Raises if a signal came (but in a push: every rank must finish it), or if a rollout
        process of any node died or went silent (heartbeats, once all have joined)."""
        if stoppable and self.stop_requested():
            raise Stopped(signal.Signals(self.stop_requested()[0]).name)
        for e, p in enumerate(self.procs):
            if p.poll() is not None:
                raise RuntimeError(f"rollout process {e} (node 0, pid {p.pid}) exited with code "
                                   f"{p.returncode}; its output, if any, is above")
        now = time.monotonic()
        for e, beat in enumerate(self.store.multi_get([f"beat{e}" for e in self.beats])):
            if beat != self.beats[e][0]:
                self.beats[e] = (beat, now)
            elif now - self.beats[e][1] > sync.DEAD_S:
                raise RuntimeError(f"rollout process {e} (node {e // self.per_node}) sent no "
                                   f"heartbeat for {sync.DEAD_S} s: it died, its node is lost, or "
                                   "it hangs; its node's log says which")

    def receive(self, traj):  # one engine's messages, until it says bye
        try:
            while (msg := sync.recv_obj(traj, 1))["kind"] != "bye":
                self.stats[msg["engine"]] = {k: msg[k] for k in rollout.COUNTERS}
                if msg["kind"] == "group":
                    self.buffer.put(msg)
                elif msg["kind"] == "eval":
                    self.evals.append(dict(msg, t=time.perf_counter()))  # when it finished
        except Exception as e:
            self.buffer.put(RuntimeError(f"lost a rollout process: {e}"))

    def idle(self, version):  # borrow_cpus: every engine waits for the weights after `version`
        mark = str(version).encode()
        return all(self.store.get(f"idle{e}") == mark for e in range(len(self.procs)))

    def resume_state(self):
        while self.next in self.done:  # every position below next is taken
            self.done.remove(self.next)
            self.next += 1
        return {"next": self.next, "done": sorted(self.done),
                "dropped": [self.buffer.dropped["stale"], self.buffer.dropped["flat"]]}

    def rollout_stats(self):  # the engines' counters, summed; since the last call, the mean share
        # of each engine's slots vLLM ran (over its steps); their last loads' pause, the mean
        now, was = {e: dict(s) for e, s in self.stats.items()}, self.last
        self.last, out = now, {k: sum(s[k] for s in now.values()) for k in rollout.COUNTERS}
        new = lambda k: [s[k] - was.get(e, {}).get(k, 0) for e, s in now.items()]
        frac = [r / n for r, n in zip(new("rollout_running"), new("rollout_steps")) if n]
        return {**out, "rollout_running_frac": sum(frac) / len(frac) if frac else None,
                "rollout_pause_s": sum(s["rollout_pause_s"] for s in now.values()) / len(now)}

    def wait(self, done, timeout_s):  # -> done(), checked every 0.1 s, at most timeout_s
        deadline = time.time() + timeout_s
        while not done() and time.time() < deadline:
            self.check_alive()
            time.sleep(0.1)
        return done()

    def stop(self, timeout_s):  # every engine, on every node, says bye; then ours exit
        sync.announce(self.ctl, -1)
        for r in self.receivers:
            r.join(timeout_s)
        for p in self.procs:
            p.wait(timeout=timeout_s)


def report_exits(procs, first, node):  # another node's engines: which died, and how
    for e, p in enumerate(procs, first):
        if p.poll() is not None and not hasattr(p, "reported"):
            p.reported = True
            print(f"error: rollout process {e} (node {node}, pid {p.pid}) exited with code "
                  f"{p.returncode}", file=sys.stderr, flush=True)


def kill(procs):
    for p in procs:
        p.kill()  # a no-op once it exited
        p.wait()
