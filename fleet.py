"""fleet.py: the rollout engines of every node, seen from the trainer.

place() gives each node's engines their GPUs (or CPU cores) and spawn() starts them. On trainer
rank 0, Fleet sets up the store and the wires (sync.py), receives what every engine sends (its
groups go into a Buffer, buffer.py), and knows whether every engine still runs. watch() makes
every trainer rank beat and watch every other rank and engine of the run, on any node.
"""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import budget
import rollout
import sync
from buffer import Buffer, Stopped
from configurator import die

TORCHRUN_ENV = ("RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT GROUP_RANK "
                "ROLE_RANK ROLE_WORLD_SIZE GROUP_WORLD_SIZE OMP_NUM_THREADS").split()


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
    # NANOASYNC_SHARE_GPU=1 (bench.py --gpu on one GPU): the engines on the trainer's GPU, as
    # separate processes, to check the separate-GPU path where only one GPU is lent
    share = cfg["colocate"] or os.environ.get("NANOASYNC_SHARE_GPU") == "1"
    gpus, first = gpus.split(","), 0 if share else local_world
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


def watch(cfg, rank, world, local_world, nodes, engines=(), grace_s=0):
    """Every trainer rank: its heartbeat in rank 0's store, and a watch on every other rank's and
    every engine's (sync.Heartbeat). `engines`: the processes this rank started on another node,
    whose deaths it reports with their exit codes."""
    E = cfg["rollout_engines"]
    peers = {f"rank{r}": f"trainer rank {r} (node {r // local_world})"
             for r in range(world) if r != rank}
    peers.update({f"beat{e}": f"rollout process {e} (node {e // E})" for e in range(E * nodes)})
    first = rank // local_world * E  # our engines' first number, if we lead another node
    return sync.Heartbeat(os.environ.get("MASTER_ADDR", "127.0.0.1"), cfg["rollout_port"],
                          f"rank{rank}", peers, first_s=cfg["start_timeout_s"],
                          loop_s=cfg["timeout_s"],
                          every=lambda store: report_exits(engines, first, rank // local_world),
                          grace_s=grace_s)


class Fleet:
    """Trainer rank 0's end of every node's rollout processes: the store, the wires, what each
    engine sends, and whether each still runs. The other ranks only join push_weights."""

    def __init__(self, cfg, plan, device, engine_gpus, ckpt, stop_requested, nodes=1, world=1,
                 local_world=1):
        self.engines = cfg["rollout_engines"] * nodes  # on every node
        self.stop_requested = stop_requested  # -> the signals received: stop at the next step
        self.evals = []  # engine 0's held-out evals, as they finish
        self.stats = {}  # engine -> its counters (rollout.COUNTERS) in its last message
        self.last = {}  # the counters at the last rollout_stats(), for rates since then
        self.done = set(ckpt.get("done", []))  # prompt stream positions trained or dropped
        self.next = ckpt.get("next", 0)  # every position below it is done
        self.procs = []  # node 0's engines
        host, timeout = os.environ.get("MASTER_ADDR", "127.0.0.1"), cfg["timeout_s"]
        try:  # port taken, or a rollout process died starting
            self.store = sync.open_store(host, cfg["rollout_port"], True, timeout)
            self.store.set("start", json.dumps({"version": ckpt.get("version", 0),
                                                "next": self.next, "done": sorted(self.done)}))
            keys = [f"rank{r}" for r in range(world)] + [f"beat{e}" for e in range(self.engines)]
            self.store.multi_set(keys, [""] * len(keys))  # heartbeats not started yet
            self.heartbeat = watch(cfg, 0, world, local_world, nodes, grace_s=sync.GRACE_S)
            self.procs = spawn(cfg, engine_gpus, 0, self.engines, host)
            joined = [f"joined{e}" for e in range(self.engines)]
            if not self.wait(lambda: self.store.check(joined), cfg["start_timeout_s"]):
                raise TimeoutError(f"the engines did not start in start_timeout_s="
                                   f"{cfg['start_timeout_s']} s")
        except (RuntimeError, TimeoutError) as e:
            kill(self.procs)
            die(str(e))
        self.ctl, trajs = sync.connect(self.store, 0, self.engines, timeout)
        self.sender = sync.Sender(self.store, plan, cfg, device,
                                  self.engines * cfg["tensor_parallel_size"])
        # a stale group's start goes back to the budget (budget.py): another may start
        discard = lambda g: budget.give_back(self.store, g["engine"])
        self.buffer = Buffer(cfg["max_staleness"], cfg["drop_flat"], discard, cfg["stall_s"])
        self.buffer.dropped = dict(zip(("stale", "flat"), ckpt.get("dropped", [0, 0])))
        self.receivers = [threading.Thread(target=self.receive, args=(t,), daemon=True)
                          for t in trajs]
        for r in self.receivers:
            r.start()

    def check_alive(self, stoppable=True):
        """Raises if a signal came (but in a push: every rank must finish it), if one of our
        engines exited, or if any rank or engine of the run went silent (the heartbeats)."""
        if stoppable and self.stop_requested():
            raise Stopped(signal.Signals(self.stop_requested()[0]).name)
        for e, p in enumerate(self.procs):
            if p.poll() is not None:
                raise RuntimeError(f"rollout process {e} (node 0, pid {p.pid}) exited with code "
                                   f"{p.returncode}; its output, if any, is above")
        if self.heartbeat.dead:
            raise RuntimeError(self.heartbeat.dead)

    def receive(self, traj):  # thread: one engine's messages into the buffer, until its bye
        try:
            while (msg := sync.recv_obj(traj, 1))["kind"] != "bye":
                self.stats[msg["engine"]] = msg["stats"]
                if msg["kind"] == "group":
                    self.buffer.put(msg)
                elif msg["kind"] == "eval":
                    self.evals.append(dict(msg, t=time.perf_counter()))  # when it finished
        except Exception as e:
            self.buffer.put(RuntimeError(f"lost a rollout process: {e}"))

    def idle(self, version):  # borrow_cpus: every engine waits for the weights after `version`
        mark = str(version).encode()
        return all(self.store.get(f"idle{e}") == mark for e in range(len(self.procs)))

    def resume_state(self):  # what a checkpoint needs to go on with the same prompt stream
        while self.next in self.done:  # every position below next is taken
            self.done.remove(self.next)
            self.next += 1
        return {"next": self.next, "done": sorted(self.done),
                "dropped": [self.buffer.dropped["stale"], self.buffer.dropped["flat"]]}

    def rollout_stats(self):
        """The engines' counters, summed; the mean share of its slots each engine's vLLM ran
        (over its steps since the last call); the mean pause of their last loads."""
        now = {e: dict(s) for e, s in self.stats.items()}
        out = {k: sum(s[k] for s in now.values()) for k in rollout.COUNTERS}
        fracs = []
        for e, s in now.items():
            steps = s["rollout_steps"] - self.last.get(e, {}).get("rollout_steps", 0)
            running = s["rollout_running"] - self.last.get(e, {}).get("rollout_running", 0)
            if steps:
                fracs.append(running / steps)
        self.last = now
        out["rollout_running_frac"] = sum(fracs) / len(fracs) if fracs else None
        out["rollout_pause_s"] = sum(s["rollout_pause_s"] for s in now.values()) / len(now)
        return out

    def wait(self, done, timeout_s):  # -> done(), checked every 0.1 s, at most timeout_s
        deadline = time.time() + timeout_s
        while not done() and time.time() < deadline:
            self.check_alive()
            time.sleep(0.1)
        return done()

    def stop(self, timeout_s):  # every engine, on every node, says bye; then ours exit
        sync.broadcast_version(self.ctl, -1)
        for r in self.receivers:
            r.join(timeout_s)
        wait_for(self.procs, timeout_s)

    def close(self):  # a clean end, once every rank has stopped watching
        self.heartbeat.stop()
        self.sender.close()


def report_exits(procs, first, node):  # another node's engines: which died, and how
    for e, p in enumerate(procs, first):
        if p.poll() is not None and p.returncode != 0 and not hasattr(p, "reported"):
            p.reported = True
            print(f"error: rollout process {e} (node {node}, pid {p.pid}) exited with code "
                  f"{p.returncode}", file=sys.stderr, flush=True)


def wait_for(procs, timeout_s):  # engines told to stop: bounded, then killed
    deadline = time.time() + timeout_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            print(f"error: rollout process pid {p.pid} did not stop in {timeout_s} s: killed",
                  file=sys.stderr, flush=True)
    kill(procs)


def kill(procs):
    for p in procs:
        p.kill()  # a no-op once it exited
        p.wait()
