"""
buffer.py: trainer rank 0's end of the rollout side. Rollouts starts the rollout processes and puts
the groups they send in a Buffer, from which the trainer takes batches, dropping stale groups (the
engines then admit replacements) and optionally flat ones (their engine replaced them already).
Simplifications: first in, first out; no priority, no replay, no memory cap beyond admission.
"""
import json
import os
import signal
import sys
import threading
import time
from collections import Counter

import configurator
import rollout
import sync
from reward import is_flat


class Stopped(Exception):
    """Ctrl-C, SIGTERM (torchrun passes both to all ranks) or a stall: stop at the step boundary."""


class Buffer:
    def __init__(self, max_staleness, drop_flat, on_discard=lambda n: None, stall_s=0):
        self.max_staleness, self.drop_flat, self.on_discard = max_staleness, drop_flat, on_discard
        self.stall_s = stall_s  # > 0: waiting this long with nothing usable stops the run
        self.groups, self.cond, self.error = [], threading.Condition(), None
        self.dropped_stale = self.dropped_flat = 0
        self.stalled_s, self.since, self.news = 0.0, [], []  # since the last usable group

    def put(self, group):
        with self.cond:
            self.groups.append(group)
            self.cond.notify()

    def fail(self, message):  # the producer is dead: get() raises this
        with self.cond:
            self.error = message
            self.cond.notify()

    def get(self, version, n_groups, check_alive=lambda: None, report=lambda text, groups: None):
        """-> (n_groups usable groups, every group taken out, seconds waited). check_alive() runs
        first and about once a second while waiting; a wait reports at least once a minute."""
        check_alive()
        batch, seen, waited, told = [], [], 0.0, 0.0
        while len(batch) < n_groups:
            with self.cond:
                t0 = time.perf_counter()
                while not self.groups and self.error is None:
                    self.cond.wait(timeout=1.0)
                    t = time.perf_counter() - t0
                    if not self.groups:
                        check_alive()
                    if waited + t - told > min(60, self.stall_s / 3 or 60):
                        report(f"waiting {waited + t:.0f} s for batch {version} ({len(batch)}/"
                               f"{n_groups} groups), {describe(self.since)}", self.news)
                        self.news, told = [], waited + t
                    if self.stall_s and self.stalled_s + t > self.stall_s:
                        raise Stopped(f"nothing usable came in stall_s={self.stall_s} s "
                                      f"({describe(self.since)}); try an easier task or a "
                                      "stronger model, --drop_flat=False, or check that the "
                                      "grader reads the answers in samples.jsonl")
                t = time.perf_counter() - t0
                waited, self.stalled_s = waited + t, self.stalled_s + t
                if self.error is not None:
                    raise RuntimeError(self.error)
                seen.append(g := self.groups.pop(0))
            if version - g["version_min"] > self.max_staleness:
                self.dropped_stale += 1
                self.on_discard(1)
                self.drop(g, "stale")
            elif self.drop_flat and is_flat(g):
                self.dropped_flat += 1
                self.drop(g, "flat")
            else:
                batch.append(g)
                self.stalled_s, self.since = 0.0, []
        return batch, seen, waited

    def drop(self, group, why):
        self.since.append((why, group["completions"][0]["reward"]))
        self.news.append(dict(group, dropped=why))


def describe(drops):  # [(why, first reward)] -> "3 groups dropped ...: 2 flat at reward 0, 1 stale"
    kinds = Counter(f"{why} at reward {r:g}" if why == "flat" else why for why, r in drops)
    return (f"{len(drops)} groups dropped since the last usable one" + ": " * bool(drops)
            + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())))


def worth_a_forward(groups, world_size):
    """A flat group adds nothing to the gradient: skip it, but as filler so that every rank runs as
    many forward passes (FSDP's collectives need that)."""
    live, flat = [g for g in groups if not is_flat(g)], [g for g in groups if is_flat(g)]
    n = max(1, -(-len(live) // world_size)) * world_size
    return live + flat[:n - len(live)]


def split(groups, world_size):  # rank r gets groups r, r + W, r + 2W, ... (a multiple of W)
    return [groups[r::world_size] for r in range(world_size)]


class Rollouts:
    """Trainer rank 0's end of the rollout processes of every node; other ranks only join push."""

    def __init__(self, cfg, buckets, device, engine_gpus, ckpt, stop_requested, nodes=1):
        self.engines, timeout = cfg["rollout_engines"] * nodes, cfg["timeout_s"]
        self.stop_requested, self.evals, self.stats = stop_requested, [], {}
        self.done, self.next = set(ckpt.get("done", [])), ckpt.get("next", 0)  # positions taken
        self.procs, host = [], os.environ.get("MASTER_ADDR", "127.0.0.1")
        try:  # port taken, or a rollout process died starting
            self.store = sync.open_store(host, cfg["rollout_port"], True, timeout)
            self.store.set("start", json.dumps({"version": ckpt.get("version", 0),
                                                "next": self.next, "done": sorted(self.done)}))
            self.procs = rollout.spawn(cfg, engine_gpus, 0, self.engines, host)
            sync.wait_for(self.store, [f"joined{e}" for e in range(self.engines)], timeout,
                          self.check_alive)
        except (RuntimeError, TimeoutError) as e:
            kill(self.procs)
            configurator.die(str(e))
        self.ctl, trajs = sync.connect(self.store, 0, self.engines, timeout)
        self.sender = sync.Sender(self.store, buckets, cfg, device,
                                  self.engines * cfg["tensor_parallel_size"])
        # a stale group dropped: the engines may admit a replacement (rollout.take_tickets)
        discard = lambda n: self.store.add("admitted", -n)
        self.buffer = Buffer(cfg["max_staleness"], cfg["drop_flat"], discard, cfg["stall_s"])
        self.buffer.dropped_stale, self.buffer.dropped_flat = ckpt.get("dropped", [0, 0])
        self.receivers = [threading.Thread(target=self.receive, args=(t,), daemon=True)
                          for t in trajs]
        for r in self.receivers:
            r.start()

    def gone(self):  # -> the first rollout process that exited, in words, or None
        for e, p in enumerate(self.procs):
            if p.poll() is not None:
                return f"rollout process {e} (pid {p.pid}) exited with code {p.returncode}"

    def check_alive(self, stoppable=True):  # not stoppable in a push: every rank must finish it
        if stoppable and self.stop_requested():
            raise Stopped(signal.Signals(self.stop_requested()[0]).name)
        if gone := self.gone():
            raise RuntimeError(f"{gone}; its own error is printed above")

    def receive(self, traj):  # one engine's messages, until it says bye
        try:
            while True:
                msg = sync.recv_obj(traj, 1)
                self.stats[msg["engine"]] = {k: msg[k] for k in rollout.COUNTERS}
                if msg["kind"] == "group":
                    self.buffer.put(msg)
                elif msg["kind"] == "eval":
                    self.evals.append(dict(msg, t=time.perf_counter()))  # when it finished
                elif msg["kind"] == "bye":
                    return
        except Exception as e:
            self.buffer.fail(f"lost a rollout process: {e}")

    def idle(self, version):  # borrow_cpus: every engine waits for the weights after `version`
        mark = str(version).encode()
        return all(self.store.get(f"idle{e}") == mark for e in range(len(self.procs)))

    def consume(self, groups):
        self.done.update(g["pos"] for g in groups)

    def resume_state(self):
        while self.next in self.done:  # every position below next is taken
            self.done.remove(self.next)
            self.next += 1
        return {"next": self.next, "done": sorted(self.done),
                "dropped": [self.buffer.dropped_stale, self.buffer.dropped_flat]}

    def rollout_stats(self):  # summed over engines (rss: the largest)
        stats = list(self.stats.values())
        return {k: (max if k == "rollout_rss_mb" else sum)(s[k] for s in stats) for k in stats[0]}

    def wait_for_eval(self, version, timeout_s):
        deadline = time.time() + timeout_s
        while not any(e["version"] == version for e in self.evals) and time.time() < deadline:
            self.check_alive()
            time.sleep(0.1)

    def explain(self, error, step):
        """If a rollout process died, say which and how; -> whether one did."""
        time.sleep(1)  # a dying process may not have exited yet
        if gone := self.gone():
            print(f"error: {gone}, so training stopped at step {step} ({type(error).__name__}: "
                  f"{str(error)[:200]}); its own error, if any, is printed above", file=sys.stderr)
        return bool(gone)

    def stop(self, timeout_s):  # every engine, on every node, says bye; then ours exit
        sync.announce(self.ctl, -1)
        for r in self.receivers:
            r.join(timeout_s)
        for p in self.procs:
            p.wait(timeout=timeout_s)


def kill(procs):
    for p in procs:
        p.kill()  # a no-op once it exited
        p.wait()
