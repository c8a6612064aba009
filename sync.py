"""sync.py: the wires between the trainer and the rollout engines. A TCPStore on trainer rank 0
sets them up, and also carries the heartbeats, the weights' plan and budget.py's counters.

Two gloo groups carry messages: ctl tells every engine each version to load, and traj brings
each engine's groups and evals back to rank 0. The weights go from trainer rank 0 to a thread in
each vLLM worker, in buckets (NCCL on GPUs, gloo on CPU; colocated, through shared memory: CUDA
IPC or /dev/shm). Staged (the default): into a copy of the weights while the engine generates,
and the engine pauses only to copy it in (load). Paused (stage_weights=False, and tensor
parallelism on GPUs): no copy; the engine pauses for the push and loads each bucket as it comes.

Simplifications: a fixed weight layout, planned once; one staging copy.
"""
import itertools
import math
import os
import pickle
import queue
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

FOREVER = 7 * 86400  # waits as long as a training step or a quiet engine: heartbeats end them
BEAT_S = 1  # a heartbeat a second
DEAD_S = 10  # a peer whose heartbeat has not moved for this long is dead
GRACE_S = 5  # after a dead peer, how long the main thread has to stop by itself
BUCKET = 2**27  # bytes a weight broadcast moves at most (a larger weight goes alone)


def open_store(host, port, master, timeout_s):  # on trainer rank 0's machine (MASTER_ADDR)
    try:
        return dist.TCPStore(host, port, is_master=master, wait_for_workers=False,
                             timeout=timedelta(seconds=timeout_s))
    except (RuntimeError, OSError) as e:
        raise RuntimeError(f"cannot open the trainer<->rollout store on {host}:{port} ({e}); "
                           "port in use? pick a free one with --rollout_port=PORT") from None


def silent(name):  # the one message for a peer whose heartbeat stopped
    return (f"{name} sent no heartbeat for {DEAD_S} s: it died, its node is lost, or it hangs; "
            "its node's log says which")


class Heartbeat:
    """A thread that adds 1 to our `key` in rank 0's store every BEAT_S, with how long ago our
    loop last moved (moved()), and watches `peers` ({key: name}): once a peer's key has moved,
    it must go on moving, and a peer's loop must move within loop_s. A peer that fails, or rank
    0's store gone, ends this process: `dead` says why (check_alive raises it in the main
    thread), and after GRACE_S the thread exits the process itself, for the main thread may be
    blocked in a collective with the dead peer. stop(): a clean end, when the store may close."""

    def __init__(self, host, port, key, peers=(), first_s=DEAD_S, loop_s=FOREVER,
                 every=lambda store: None, grace_s=0):
        self.key = key
        self.grace_s = grace_s  # rank 0's main thread raises `dead` itself: it gets GRACE_S
        self.peers = dict(peers)
        self.loop_s = loop_s
        self.every = every  # more work each beat (another node's leader: its engines' exits)
        self.last_move = None  # when our loop last moved; None: we vouch for no loop
        self.dead = None  # why this process must end
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self.run, args=(host, port, first_s), daemon=True)
        self.thread.start()

    def moved(self):  # the loop we vouch for made progress
        self.last_move = time.monotonic()

    def stop(self):  # a clean end: the thread says "bye" (the watchers let us go), then ends
        self.stopped.set()
        self.thread.join(DEAD_S)

    def run(self, host, port, first_s):
        try:
            store = open_store(host, port, False, first_s)
            store.set_timeout(timedelta(seconds=DEAD_S))
            seen = {}  # peer key -> (its last beat, when it changed)
            for n in itertools.count():
                idle = time.monotonic() - (self.last_move or time.monotonic())
                store.set(self.key, f"{n} {idle:.0f}")
                self.every(store)
                if self.peers:
                    self.watch(store.multi_get(list(self.peers)), seen)
                if self.stopped.wait(BEAT_S):
                    store.set(self.key, "bye")
                    return
        except Exception as e:
            if not self.stopped.is_set():  # a clean end closes the store: no error then
                self.fail(f"trainer rank 0's store on {host}:{port} is gone ({e})")

    def watch(self, beats, seen):
        now = time.monotonic()
        for (key, name), beat in zip(self.peers.items(), beats):
            if beat in (b"", b"bye"):  # not started yet (rank 0 made every key empty), or ended
                continue
            n, idle = beat.decode().split()
            if seen.get(key, (None,))[0] != n:
                seen[key] = (n, now)
            if now - seen[key][1] > DEAD_S:
                self.fail(silent(name))
            if int(idle) > self.loop_s:
                self.fail(f"{name}: its loop has not moved for {idle} s (hung in vLLM or a "
                          "driver? `py-spy dump --pid PID` shows where)")

    def fail(self, why):
        self.dead = why
        if not self.stopped.wait(self.grace_s):
            print(f"error: {self.key}: {why}", file=sys.stderr, flush=True)
            os._exit(1)  # at once: nothing waits on a dead peer (NCCL would, for its timeout)


def gloo(store, name, rank, size, timeout_s):
    return dist.ProcessGroupGloo(dist.PrefixStore(name, store), rank, size,
                                 timedelta(seconds=timeout_s))


def connect(store, rank, engines, timeout_s):  # rank 0: the trainer; rank 1 + e: engine e
    ctl = gloo(store, "ctl", rank, 1 + engines, timeout_s if rank == 0 else FOREVER)
    if rank == 0:  # an engine may have nothing to send for long: its heartbeat says it lives
        return ctl, [gloo(store, f"traj{e}", 0, 2, FOREVER) for e in range(engines)]
    return ctl, gloo(store, f"traj{rank - 1}", 1, 2, timeout_s)


def send_obj(pg, obj, dst):
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    pg.send([torch.tensor([data.numel()])], dst, 0).wait()
    pg.send([data], dst, 1).wait()


def recv_obj(pg, src):
    size = torch.zeros(1, dtype=torch.int64)
    pg.recv([size], src, 0).wait()
    data = torch.empty(int(size), dtype=torch.uint8)
    pg.recv([data], src, 1).wait()
    return pickle.loads(data.numpy().tobytes())


def broadcast_version(pg, version=0):
    """ctl: trainer rank 0 tells every engine the version to load (-1: stop). Every member calls
    it; each gets rank 0's version."""
    v = torch.tensor([version])
    pg.broadcast(v, 0).wait()
    return int(v)


def finish(work, check_alive=lambda: None):  # NCCL's wait() only gates a stream: poll the host
    while not work.is_completed():
        check_alive()
        time.sleep(0.005)
    work.wait()  # raises its error, if it failed


def plan(meta, dtype):
    """[(name, shape)] -> [(offset, numel, [(name, shape)])]: the weights in buckets of
    consecutive ones, each at most BUCKET bytes (a larger weight alone), at their offsets in one
    flat copy. Trainer and workers make the same plan: a bucket is one broadcast."""
    buckets, offset, limit = [], 0, BUCKET // dtype.itemsize
    for name, shape in meta:
        n = math.prod(shape)
        if not buckets or buckets[-1][1] + n > limit:
            buckets.append((offset, 0, []))
        off, size, weights = buckets[-1]
        buckets[-1] = (off, size + n, weights + [(name, tuple(shape))])
        offset += n
    return buckets


def weights_in(flat, weights):  # a bucket's flat tensor -> (name, a view of it shaped)
    sizes = [math.prod(shape) for _, shape in weights]
    return [(name, part.view(shape)) for (name, shape), part in zip(weights, flat.split(sizes))]


def staging(plan, cfg, device):  # a flat copy of every weight; colocated on CPU, in /dev/shm
    size, dtype = sum(n for _, n, _ in plan), getattr(torch, cfg["rollout_dtype"])
    if cfg["colocate"] and device.type == "cpu":
        path = f"/dev/shm/nanoasync-{cfg['rollout_port']}"  # Sender unlinks it once all mapped
        return torch.from_file(path, shared=True, size=size, dtype=dtype)
    return torch.empty(size, dtype=dtype, device=device)


def staged(cfg):  # True: the engines receive while generating, into a copy (sync's docstring)
    return cfg["stage_weights"] and not (torch.cuda.is_available()
                                         and cfg["tensor_parallel_size"] > 1)


def weight_groups(store, rank, world, device, colocate, timeout_s):
    """-> (wake: gloo, a push begins; the weights: NCCL on GPU, else gloo)."""
    wake = gloo(store, "wake", rank, world, timeout_s if rank == 0 else FOREVER)
    # NCCL refuses two ranks on one GPU: sharing it for a check, gloo carries the CUDA tensors
    if device.type == "cuda" and not colocate and os.environ.get("NANOASYNC_SHARE_GPU") != "1":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timedelta(seconds=timeout_s)
        # a waiting receive kernel holds its SMs: on an engine's GPU, few, beside vLLM's kernels
        opts.config.max_ctas = 4
        pg = dist.ProcessGroupNCCL(dist.PrefixStore("weights", store), rank, world, opts)
        pg.eager_connect_single_device(device)  # every member connects now, not in the first push
        return wake, pg
    pg = gloo(store, "weights", rank, world, timeout_s)
    if colocate:
        barrier(pg, device)  # every side has mapped the staging copy
    return wake, pg


def barrier(pg, device):
    if device.type == "cuda":
        torch.cuda.current_stream().synchronize()  # other processes see only completed work
    pg.allreduce([torch.zeros(1)]).wait()


class Sender:  # trainer rank 0's end of the weight groups
    def __init__(self, store, plan, cfg, device, workers):
        self.plan, self.device, self.colocate = plan, device, cfg["colocate"]
        self.dtype = getattr(torch, cfg["rollout_dtype"])
        if self.colocate:  # the workers' staging copy itself
            self.copy = staging(plan, cfg, device)
            if device.type == "cuda":
                from torch.multiprocessing.reductions import reduce_tensor
                store.set("ipc", pickle.dumps(reduce_tensor(self.copy)))
        else:  # two buckets: one is filled while the other is sent
            size = max([n for _, n, weights in plan if len(weights) > 1], default=0)
            self.buckets = [torch.empty(size, dtype=self.dtype, device=device) for _ in range(2)]
        store.set("plan", pickle.dumps(plan))  # last: the workers wait for it
        self.wake, self.pg = weight_groups(store, 0, 1 + workers, device, self.colocate,
                                           cfg["timeout_s"])
        if self.colocate and device.type == "cpu":  # all mapped: nothing left, even after kill -9
            os.unlink(self.copy.untyped_storage().filename)

    def close(self):  # a clean end: NCCL's communicator is shut down, not left to its destructor
        if type(self.pg).__name__ == "ProcessGroupNCCL":
            self.pg.shutdown()


def push(sender, tensors, version, check_alive=lambda: None):
    """Trainer rank 0: the weights, (name, full tensor) in plan order, to every vLLM worker as
    `version`. Each bucket is filled while the one before it is on its way."""
    finish(sender.wake.allreduce([torch.tensor([version])]), check_alive)  # a push begins
    works = []
    for i, (offset, n, weights) in enumerate(sender.plan):
        if len(works) == 2:  # the broadcast of bucket i - 2, which used this buffer, is done
            finish(works.pop(0), check_alive)
        if sender.colocate:
            flat = sender.copy[offset:offset + n]
        elif len(weights) == 1:  # a weight alone goes as it is: no copy, no buffer its size
            flat = None
        else:
            flat = sender.buckets[i % 2][:n]
        for name, part in weights_in(flat, weights) if flat is not None else [(weights[0][0], None)]:
            got, t = next(tensors)
            assert got == name, f"weight order changed: expected {name}, got {got}"
            if part is None:
                flat = t.detach().to(sender.dtype).reshape(-1)
            else:
                part.copy_(t.detach())
        if not sender.colocate:
            works.append(sender.pg.broadcast(flat, 0))
    if sender.colocate:
        barrier(sender.pg, sender.device)  # all of it is in place
    for w in works:
        finish(w, check_alive)


def join(worker, cfg, first_rank):  # in each vLLM worker (collective_rpc): start receiving
    cuda, port = torch.cuda.is_available(), cfg["rollout_port"]
    device = torch.device(f"cuda:{torch.cuda.current_device()}" if cuda else "cpu")
    store = open_store(cfg["host"], port, False, cfg["timeout_s"])
    store.wait(["plan"])
    plan = pickle.loads(store.get("plan"))
    copy = None  # paused: no copy at all
    if cfg["colocate"] and cuda:  # CUDA IPC: open the trainer's
        fn, args = pickle.loads(store.get("ipc"))
        copy = fn(*args)
    elif cfg["colocate"] or staged(cfg):
        copy = staging(plan, cfg, device)
    world = 1 + cfg["engines"] * cfg["tensor_parallel_size"]
    groups = weight_groups(store, first_rank + worker.rank, world, device, cfg["colocate"],
                           cfg["timeout_s"])
    worker.nanoasync = s = dict(
        copy=copy, plan=plan, device=device, groups=groups, colocate=cfg["colocate"],
        dtype=getattr(torch, cfg["rollout_dtype"]), timeout_s=cfg["timeout_s"],
        staged=queue.Queue(),  # the staging thread's received versions (or its error)
        loaded=threading.Event())  # load() has copied the last one in: receive the next
    if copy is not None:
        threading.Thread(target=stage, args=(s,), daemon=True).start()


def receive(s):
    """One push. Staged or colocated: into the copy, -> its version. Paused: -> (version, a
    generator of (name, weight) that receives each bucket as copy_in() reaches it)."""
    if s["device"].type == "cuda":
        torch.cuda.set_device(s["device"])  # a new thread starts on GPU 0
    wake, pg = s["groups"]
    version = torch.zeros(1, dtype=torch.int64)
    wake.allreduce([version]).wait()  # a push begins: the trainer's version, 0s from us
    if s["colocate"]:
        barrier(pg, s["device"])  # the trainer has written it
        return int(version)
    if s["copy"] is None:
        return int(version), received(s)
    stream = torch.cuda.Stream(s["device"]) if s["device"].type == "cuda" else None
    with torch.cuda.stream(stream):  # None (CPU): a no-op
        works = [pg.broadcast(s["copy"][offset:offset + n], 0) for offset, n, _ in s["plan"]]
    for w in works:
        finish(w)
    return int(version)


def received(s):  # paused: a bucket at a time, each in its own tensor (vLLM may keep views)
    for _, n, weights in s["plan"]:
        flat = torch.empty(n, dtype=s["dtype"], device=s["device"])
        s["groups"][1].broadcast(flat, 0).wait()  # on a GPU: the stream waits, not the host
        yield from weights_in(flat, weights)


def stage(s):
    """Thread in each worker: each push into the staging copy beside vLLM's forward passes, on a
    stream no kernel of vLLM's waits on."""
    try:
        while True:
            s["staged"].put(receive(s))
            s["loaded"].wait()  # load() has copied it: the next push may overwrite it
            s["loaded"].clear()
    except Exception as e:  # load() raises it
        s["staged"].put(e)


def load(worker):  # in each vLLM worker (collective_rpc): the engine's pause -> the version
    s, cuda = worker.nanoasync, torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()  # no forward pass reads the old weights (nor all-reduces run)
    if s["copy"] is None:  # paused: the push itself, a bucket at a time
        version, weights = receive(s)
    else:
        try:
            version = s["staged"].get(timeout=s["timeout_s"])
        except queue.Empty:
            raise TimeoutError(f"no weights came in timeout_s={s['timeout_s']} s") from None
        if isinstance(version, Exception):
            raise RuntimeError(f"receiving weights failed: {version}")
        weights = (w for offset, n, ws in s["plan"]
                   for w in weights_in(s["copy"][offset:offset + n], ws))
    copy_in(worker, weights)
    if cuda:
        torch.cuda.synchronize()  # done with the staging copy; every stream sees the new weights
    s["loaded"].set()
    return version


def copy_in(worker, weights):  # (name, tensor) into vLLM's weights, in place
    from vllm.config import set_current_vllm_config
    with set_current_vllm_config(worker.vllm_config):  # as vLLM's own reloads (quantized layers)
        worker.model_runner.reload_weights(weights_iterator=weights)
    model = worker.model_runner.get_model()
    if not torch.cuda.is_available() and getattr(model.config, "tie_word_embeddings", False):
        # the CPU backend pre-packs lm_head for its GEMM: re-pack it from the new tied weight
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
        dispatch_cpu_unquantized_gemm(model.lm_head, remove_weight=False)
