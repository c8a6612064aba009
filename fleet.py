"""fleet.py: the trainer's view of the engines: place() (GPUs or cores), spawn(), watch()
(each rank's heartbeat); on rank 0 Fleet: the store, the wires, a Buffer of what they send.

Runs in the trainer ranks: place() and watch() on every rank, spawn() on each node's first rank
(its engines), Fleet on rank 0 alone. Nothing here runs in an engine: the engines' own code is
rollout.py, which this file starts as a separate program."""
import json, os, signal, subprocess, sys, threading, time
from contextlib import suppress

import torch

import sync
from buffer import Buffer, Stopped
from configurator import die

TORCHRUN_ENV = """RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT GROUP_RANK
ROLE_RANK ROLE_WORLD_SIZE GROUP_WORLD_SIZE OMP_NUM_THREADS""".split()
ROOT = os.path.dirname(os.path.abspath(__file__))  # rollout.py's folder


def cpus(spec):  # rollout_cpus "1" or "2-3" -> {cores}
    lo, _, hi = spec.partition("-")
    return set(range(int(lo), int(hi or lo) + 1)) if spec else set()


def place(cfg, world, local_world, device, leader):
    """-> (engine_gpus, borrow). engine_gpus: on a node's leader (its first rank), one list an
    engine of this node, of the GPUs it runs on: those after the node's trainer ranks' (CPU:
    empty lists); elsewhere []. borrow: how many of vLLM's cores a lone CPU rank uses while
    every engine waits for its weights (0: none). On a CPU it also takes this rank off vLLM's
    cores (rollout_cpus) and sets its thread count; on a GPU it picks this rank's device."""
    E, tp = cfg["rollout_engines"], cfg["tensor_parallel_size"]
    if device.type == "cpu":
        cores = cpus(cfg["rollout_cpus"])  # vLLM's
        borrow = len(cores) if cfg["borrow_cpus"] and world == 1 else 0
        ours = os.sched_getaffinity(0) - cores
        if cores and not borrow:
            os.sched_setaffinity(0, ours)
        # a thread a core of ours (OpenMP's default spins on vLLM's)
        torch.set_num_threads(
            int(os.environ.get("OMP_NUM_THREADS") or max(1, len(ours) // local_world)))
        return [[] for _ in range(E)] if leader else [], borrow
    torch.cuda.set_device(device)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = visible.split(",") if visible else [str(g) for g in range(torch.cuda.device_count())]
    first = 0 if sync.shared_gpu(cfg) else local_world  # engines on the trainer's GPU?
    if leader and cfg["colocate"] and world * E * tp != 1:  # CUDA IPC: one device
        die("--colocate needs 1 trainer rank and 1 engine on one GPU: --nproc_per_node=1 "
            "--rollout_engines=1 --tensor_parallel_size=1, or no --colocate")
    if leader and first + E * tp > len(gpus):
        die(f"{local_world} trainer ranks + {E} engines x tensor_parallel_size={tp} exceed this "
            f"node's {len(gpus)} GPUs: fewer ranks or --rollout_engines, or --colocate")
    return [gpus[first + e * tp:first + (e + 1) * tp] for e in range(E)] if leader else [], 0


def spawn(cfg, engine_gpus, first, engines, host, plan):  # this node's engines, from first
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV and "TORCHELASTIC" not in k}
    env.update(PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""),  # for sync
               VLLM_ENABLE_V1_MULTIPROCESSING="0")  # its core in-process: per-token tags
    cores = sorted(cpus(cfg["rollout_cpus"]))  # (rollout.py pins itself to them)
    if cores:
        env.update(VLLM_CPU_OMP_THREADS_BIND=cfg["rollout_cpus"], OMP_NUM_THREADS=str(len(cores)))
    if cfg["rollout_dtype"] == "float32":  # Triton attention in IEEE fp32, not TF32
        env.setdefault("TRITON_F32_DEFAULT", "ieee")
    share = cfg["gpu_memory_utilization"]
    if torch.cuda.is_available() and not cfg["colocate"] and sync.staging(cfg):
        size = sum(n for _, n, _ in plan) * getattr(torch, cfg["rollout_dtype"]).itemsize
        share -= size / torch.cuda.get_device_properties().total_memory
        if share < 0.05:
            die(f"the staging copy ({size / 2**30:.1f} GiB) leaves vLLM too little of "
                f"gpu_memory_utilization={cfg['gpu_memory_utilization']}: raise it, or "
                "--stage_weights=False (paused pushes, no copy)")
    cfg = json.dumps(dict(cfg, engines=engines, host=host, gpu_memory_utilization=share,
                          cores=cores))
    return [subprocess.Popen([sys.executable, f"{ROOT}/rollout.py", cfg, str(first + e)],
                             env=dict(env, CUDA_VISIBLE_DEVICES=",".join(gpus)) if gpus else env)
            for e, gpus in enumerate(engine_gpus)]


def store_host(nodes):  # where rank 0's store listens: one node needs no network
    return os.environ["MASTER_ADDR"] if nodes > 1 else "127.0.0.1"


def watch(cfg, rank, world, local_world, nodes, engines=()):  # a rank's heartbeat (sync.py)
    E = cfg["rollout_engines"]
    peers = {f"rank{r}": f"trainer rank {r} (node {r // local_world})"
             for r in range(world) if r != rank}
    peers.update({f"beat{e}": f"rollout process {e} (node {e // E})" for e in range(E * nodes)})
    return sync.Heartbeat(
        store_host(nodes), cfg["rollout_port"], f"rank{rank}", peers, cfg["start_timeout_s"],
        cfg["timeout_s"], lambda: report_exits(engines, rank // local_world, E))


class Fleet:  # rank 0's end of each engine
    def __init__(self, cfg, plan, device, engine_gpus, ckpt, stop_requested, nodes=1, world=1,
                 local_world=1):
        self.engines = cfg["rollout_engines"] * nodes
        self.per_node = cfg["rollout_engines"]
        self.stop_requested = stop_requested  # -> signals received
        self.evals = []  # engine 0's, as they finish
        self.stats = {}  # engine -> its last counters
        self.last = {}  # counters at the last rollout_stats()
        self.done = set(ckpt.get("done", []))  # stream positions taken
        self.next = ckpt.get("next", 0)  # each position below it too
        self.procs = []  # node 0's engines
        self.sender = None  # the weights' (sync.Sender), once all engines joined
        host = store_host(nodes)
        try:  # a port taken, an engine dead
            self.store = sync.open_store(host, cfg["rollout_port"], True, cfg["timeout_s"])
            self.store.set("start", json.dumps(
                {"version": ckpt.get("version", 0), "next": self.next, "done": sorted(self.done)}))
            keys = [f"rank{r}" for r in range(world)] + [f"beat{e}" for e in range(self.engines)]
            self.store.multi_set(keys, [""] * len(keys))  # no heartbeat yet
            self.heartbeat = watch(cfg, 0, world, local_world, nodes)
            self.procs = spawn(cfg, engine_gpus, 0, self.engines, host, plan)
            joined = [f"joined{e}" for e in range(self.engines)]
            if not self.wait(lambda: self.store.check(joined), cfg["start_timeout_s"]):
                raise TimeoutError(f"engines not up in start_timeout_s={cfg['start_timeout_s']} s")
        except (RuntimeError, TimeoutError) as e:
            kill(self.procs)
            die(str(e))
        ctls, trajs = sync.connect(self.store, 0, self.engines, cfg["timeout_s"])
        self.sender = sync.Sender(self.store, plan, cfg, device, ctls)
        discard = lambda g: self.store.add("started", -1)
        self.buffer = Buffer(cfg["max_staleness"], cfg["drop_flat"], discard, cfg["stall_s"])
        self.buffer.dropped.update(zip(("stale", "flat"), ckpt.get("dropped", ())))
        self.receivers = [threading.Thread(target=self.receive, args=(e, t), daemon=True)
                          for e, t in enumerate(trajs)]
        for r in self.receivers:
            r.start()

    def check_alive(self, stoppable=True):
        """Raises for a signal (not in a push: all ranks finish it), an engine's exit or a failed
        send of weights."""
        if stoppable and self.stop_requested():
            raise Stopped(signal.Signals(self.stop_requested()[0]).name)
        for e, p in enumerate(self.procs):
            if p.poll() is not None:
                raise RuntimeError(f"rollout process {e} (node 0, pid {p.pid}) exited with code "
                                   f"{p.returncode}; its output is above")
        if self.sender and self.sender.error:  # seen here, between steps: a checkpoint can follow
            raise RuntimeError(self.sender.error)

    def receive(self, e, traj):  # a thread an engine, until its bye
        try:
            while (msg := sync.recv_obj(traj, 1))["kind"] != "bye":
                self.stats[msg["engine"]] = msg["stats"]
                if msg["kind"] == "group":
                    self.buffer.put(msg)
                elif msg["kind"] == "eval":
                    self.evals.append(dict(msg, t=time.perf_counter()))
        except Exception as err:  # its node: engines are numbered node by node
            where = f"node {e // self.per_node}"
            self.buffer.put(RuntimeError(f"lost rollout process {e} ({where}): {err}"))

    def idle(self, version):  # borrow_cpus: each engine waits
        mark = str(version).encode()
        return all(self.store.get(f"idle{e}") == mark for e in range(len(self.procs)))

    def resume_state(self):  # for a checkpoint
        while self.next in self.done:
            self.done.remove(self.next)
            self.next += 1
        return dict(next=self.next, done=sorted(self.done), dropped=[*self.buffer.dropped.values()])

    def rollout_stats(self):
        """-> each of the engines' counters (rollout.COUNTERS), summed over engines, since the run
        began; rollout_running_frac: the mean over engines of how full each one's batch was
        (training sequences in vLLM / rollout_seqs, averaged over its steps) since the last call;
        rollout_pause_s: the engines' last pause for a load, averaged."""
        now = {e: dict(s) for e, s in self.stats.items()}
        delta = lambda e, k: now[e][k] - self.last.get(e, {}).get(k, 0)
        fracs = [delta(e, "rollout_running") / delta(e, "rollout_steps") for e in now
                 if delta(e, "rollout_steps")]
        self.last = now
        return {**{k: sum(s[k] for s in now.values()) for k in next(iter(now.values()))},
                "rollout_running_frac": sum(fracs) / len(fracs) if fracs else None,
                "rollout_pause_s": sum(s["rollout_pause_s"] for s in now.values()) / len(now)}

    def wait(self, done, timeout_s):
        deadline = time.time() + timeout_s
        while not done() and time.time() < deadline:
            self.check_alive()
            time.sleep(0.1)
        return done()

    def stop(self, timeout_s):  # each engine says bye; ours exit
        self.sender.stop(timeout_s)
        for r in self.receivers:
            r.join(timeout_s)
        kill(self.procs, timeout_s)

    def close(self):  # a clean end, no rank watching
        self.heartbeat.stop()
        self.sender.close()


def report_exits(procs, node, per_node):  # another node's engines (numbered node by node)
    for e, p in enumerate(procs, node * per_node):
        if p.poll() not in (None, 0) and not hasattr(p, "reported"):
            p.reported = True
            print(f"error: rollout process {e} (node {node}, pid {p.pid}) exited with code "
                  f"{p.returncode}", file=sys.stderr)


def kill(procs, timeout_s=0):  # given timeout_s to exit
    deadline = time.time() + timeout_s
    for p in procs:
        with suppress(subprocess.TimeoutExpired):
            p.wait(timeout=max(0.01, deadline - time.time()))
        p.kill()  # a no-op once it exited
        p.wait()
