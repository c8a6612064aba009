"""sync.py: trainer<->engine wires via rank 0's TCPStore (heartbeats too): each engine's
ctl (versions), traj (groups), weights (Sender), received into a copy as it generates
(stage_weights=False, TP on GPUs: paused, by buckets). Simplifications: a fixed layout, one copy.

Runs in four places: every trainer rank (the store's clients, heartbeats), rank 0's sender
threads (one per engine), each engine's loop (versions, groups), and each vLLM worker inside an
engine (join, receive, load: the weights themselves). Rank 0's store keys (who writes, who reads):
  start        rank 0 / engines: the version and prompt stream to begin from (JSON)
  plan         rank 0 / workers: each weight's place in the flat copy (JSON)
  shm, ipc     rank 0 / workers, colocated: the shared copy's file, or its CUDA IPC handle
  rank{r}, beat{e}  each rank, engine / everyone: heartbeats, "count idle_seconds", or "bye"
  joined{e}    engine / rank 0: it is up
  idle{e}      engine / rank 0: the version it waits for (borrow_cpus), "" while busy
  loaded{e}    engine / other engines: its version (budget.py's reserve)
  started, pos engines / engines: groups started (the budget), stream positions taken
  ctl{e}/, traj{e}/, wake{e}/, weights{e}/  the process groups' own keys (PrefixStore)"""
import dataclasses, io, itertools, json, math, os
import pickle, queue, socket, sys, tempfile, threading, time
from datetime import timedelta

import torch
import torch.distributed as dist

import lora

FOREVER = 7 * 86400  # long steps, quiet engines: heartbeats end it
BEAT_S = 1
DEAD_S = 10  # a peer silent this long is dead
BUCKET = 2**27  # max bytes a broadcast moves


# ---- everywhere: rank 0's store, what may be unpickled from it, heartbeats ----
def open_store(host, port, master, timeout_s):
    """Rank 0's store (master) or a client of it. The master listens on `host` alone: loopback
    for one node, the interface MASTER_ADDR names for several (TCPStore by itself would listen on
    every interface, open to any host that reaches the machine). Whoever reaches it can still
    stop or stall the run: see the README's Security paragraph."""
    try:
        listen = None
        if master:  # the address getaddrinfo resolves `host` to; create_server: reuse, bind, listen
            family, _, _, _, addr = socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM)[0]
            listen = socket.create_server(addr, family=family, backlog=128).detach()  # the store's
        return dist.TCPStore(host, port, is_master=master, wait_for_workers=False,
                             timeout=timedelta(seconds=timeout_s), master_listen_fd=listen)
    except (RuntimeError, OSError) as e:
        raise RuntimeError(f"cannot open the trainer<->rollout store on {host}:{port} ({e}); "
                           "port in use? pick a free one: --rollout_port=PORT") from None


# What may be unpickled from a peer: numpy arrays (groups), and the parts of a CUDA tensor's IPC
# handle (colocate). Anything else (a function, os.system) is refused, so bytes written into
# the store or the wires by another process cannot run code in ours.
SAFE = {("numpy", "ndarray"), ("numpy", "dtype"), ("torch", "Size"), ("torch", "Tensor"),
        ("torch", "UntypedStorage"), ("torch.storage", "UntypedStorage"),
        ("torch.multiprocessing.reductions", "rebuild_cuda_tensor")}
SAFE |= {(f"numpy.{core}.{mod}", name) for core in ("core", "_core") for mod, name in
         (("multiarray", "_reconstruct"), ("multiarray", "scalar"), ("numeric", "_frombuffer"))}


class Restricted(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) in SAFE or module == "torch" and isinstance(
                getattr(torch, name, None), torch.dtype):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refused to unpickle {module}.{name} from a peer")


def loads(data):  # pickle.loads, for plain data, arrays and tensor handles only
    return Restricted(io.BytesIO(data)).load()


class Heartbeat:
    """A thread: each BEAT_S `key` gets a count and our loop's idle seconds; a peer ({key: name})
    silent or idle past loop_s, or a lost store, ends us; stop() says bye."""

    def __init__(self, host, port, key, peers=(), first_s=DEAD_S, loop_s=FOREVER,
                 every=lambda: None):
        self.key, self.peers, self.loop_s = key, dict(peers), loop_s
        self.every = every  # a node leader reports its engines' exits
        self.last_move = None  # None: we vouch for no loop
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self.run, args=(host, port, first_s), daemon=True)
        self.thread.start()

    def moved(self):
        self.last_move = time.monotonic()

    def forget(self, ranks=False):  # on the way out, engines' (and ranks') silence is no news
        self.peers = {k: n for k, n in self.peers.items() if not (ranks or k.startswith("beat"))}

    def stop(self):
        self.stopped.set()
        self.thread.join(DEAD_S)

    def run(self, host, port, first_s):
        seen = {}  # key -> (last count, when it changed)
        try:
            store = open_store(host, port, False, first_s)
            store.set_timeout(timedelta(seconds=DEAD_S))
            for n in itertools.count():
                idle = time.monotonic() - (self.last_move or time.monotonic())
                store.set(self.key, f"{n} {max(0, int(idle))}")
                self.every()
                quiet, peers = {}, self.peers  # name -> seconds since its count changed
                for (key, name), beat in zip(peers.items(), store.multi_get([*peers])):
                    if beat not in (b"", b"bye"):  # begun (rank 0 set all empty), not ended
                        quiet[name] = self.check(key, name, beat, seen)
                if max(quiet.values(), default=0) > DEAD_S:  # it, and any silent with it
                    self.fail(*(f"{name} sent no heartbeat for {DEAD_S} s: dead, hung or node lost"
                                for name, s in quiet.items() if s > DEAD_S / 2))
                if self.stopped.wait(BEAT_S):
                    return store.set(self.key, "bye")
        except Exception as e:
            if not self.stopped.is_set():  # a clean end closes the store
                self.fail(f"trainer rank 0's store on {host}:{port} is gone ({e})")

    def check(self, key, name, beat, seen):
        n, _, idle = beat.decode(errors="replace").partition(" ")
        if not (n.isdigit() and idle.isdigit()):  # we write "count idle_seconds"
            self.fail(f"{name}'s heartbeat key {key!r} holds {beat[:40]!r}: another process "
                      "writes to the store; keep --rollout_port to this run (README, Security)")
        if seen.get(key, (None,))[0] != n:
            seen[key] = (n, time.monotonic())
        if int(idle) > self.loop_s:
            self.fail(f"{name}: its loop has not moved for {idle} s (hung? `py-spy dump --pid "
                      "PID` shows where)")
        return time.monotonic() - seen[key][1]

    def fail(self, *whys):
        for why in whys:
            print(f"error: {self.key}: {why}", file=sys.stderr)
        os._exit(1)  # now: a collective would wait on the dead peer


# ---- the wires: rank 0 and each engine's loop (ctl: versions, traj: groups) ----
def gloo(store, name, rank, size, timeout_s):
    return dist.ProcessGroupGloo(
        dist.PrefixStore(name, store), rank, size, timedelta(seconds=timeout_s))


def connect(store, rank, engines, timeout_s):  # rank 0 -> [ctl], [traj]; 1 + e -> engine e's
    if rank == 0:  # engines may be quiet long: heartbeats tell
        return ([gloo(store, f"ctl{e}", 0, 2, timeout_s) for e in range(engines)],
                [gloo(store, f"traj{e}", 0, 2, FOREVER) for e in range(engines)])
    e = rank - 1
    return gloo(store, f"ctl{e}", 1, 2, FOREVER), gloo(store, f"traj{e}", 1, 2, timeout_s)


def send_obj(pg, obj, dst):
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    pg.send([torch.tensor([data.numel()])], dst, 0).wait()
    pg.send([data], dst, 1).wait()


def recv_obj(pg, src):
    size = torch.zeros(1, dtype=torch.int64)
    pg.recv([size], src, 0).wait()
    data = torch.empty(int(size), dtype=torch.uint8)
    pg.recv([data], src, 1).wait()
    return loads(data.numpy().tobytes())


def broadcast_version(pg, version=0):  # ctl: rank 0's version to the engine (-1: stop)
    v = torch.tensor([version])
    pg.broadcast(v, 0).wait()
    return int(v)


def finish(work, check_alive=lambda: None):  # NCCL's wait() only gates a stream: poll
    while not work.is_completed():
        check_alive()
        time.sleep(0.005)
    work.wait()  # raises its error


def broadcast_copy(pg, flat, plan, stream=None, filled=None):
    """Rank 0's flat copy into each receiver's, bucket by bucket, on `stream` (None: the current
    one). Rank 0's stream first waits for the event `filled` (the snapshot's fill), so that NCCL
    waits for the fill and not for whatever the trainer queued after it. The stream is the
    caller's: streams come from a pool, and two sender threads sharing one would make an older
    send wait for a newer fill. The works (they hold views of flat) go when this returns."""
    with torch.cuda.stream(stream):
        if filled:
            stream.wait_event(filled)
        works = [pg.broadcast(flat[o:o + n], 0) for o, n, _ in plan]
    for work in works:
        finish(work)


# ---- the weights' layout and groups: rank 0 and each vLLM worker alike ----
def plan(meta, dtype):  # [(name, shape)] -> buckets [(offset, numel, [(name, shape)])]
    buckets, o = [], 0
    for name, shape in meta:
        n = math.prod(shape)
        if not buckets or (buckets[-1][1] + n) * dtype.itemsize > BUCKET:
            buckets.append((o, 0, []))
        start, size, weights = buckets[-1]
        buckets[-1] = (start, size + n, weights + [(name, tuple(shape))])
        o += n
    return buckets


def weights_in(flat, weights):  # a bucket's flat tensor -> [(name, view)]
    sizes = [math.prod(shape) for _, shape in weights]
    return [(name, part.view(shape)) for (name, shape), part in zip(weights, flat.split(sizes))]


def new_copy(plan, cfg, device, path=None):  # a flat copy (colocated CPUs: a file in /dev/shm)
    size, dtype = sum(n for _, n, _ in plan), getattr(torch, cfg["rollout_dtype"])
    if path:  # unlinked once all mapped
        return torch.from_file(path, shared=True, size=size, dtype=dtype)
    return torch.empty(size, dtype=dtype, device=device)


def staging(cfg):  # engines receive into a copy as they generate (else paused, by buckets)
    tp = torch.cuda.is_available() and cfg["tensor_parallel_size"] > 1
    return cfg["stage_weights"] and not tp


def shared_gpu(cfg):  # engines on the trainer's GPU (bench.py --gpu: over gloo)
    return cfg["colocate"] or os.environ.get("NANOASYNC_SHARE_GPU") == "1"


def weight_groups(store, e, rank, device, cfg):  # engine e's (wake, weights: NCCL on GPU)
    world = 1 + cfg["tensor_parallel_size"]  # rank 0 and the engine's workers
    wake = gloo(store, f"wake{e}", rank, world, cfg["timeout_s"] if rank == 0 else FOREVER)
    if device.type == "cuda" and not shared_gpu(cfg):  # NCCL refuses two ranks on one GPU
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timedelta(seconds=cfg["timeout_s"])
        opts.config.max_ctas = 4  # a waiting receive holds its SMs: few
        pg = dist.ProcessGroupNCCL(dist.PrefixStore(f"weights{e}", store), rank, world, opts)
        pg.eager_connect_single_device(device)  # now, not in the first push
        return wake, pg
    pg = gloo(store, f"weights{e}", rank, world, cfg["timeout_s"])
    if cfg["colocate"]:
        barrier(pg, device)  # all mapped the shared copy
    return wake, pg


def barrier(pg, device):
    if device.type == "cuda":
        torch.cuda.current_stream().synchronize()  # others see completed work only
    pg.allreduce([torch.zeros(1)]).wait()


# ---- on rank 0: the sender (its threads, one an engine) ----
class Sender:
    """Rank 0's end of the weights. push() fills a snapshot of the new weights; a thread an engine
    waits until its engine is ready (it loaded the last), then sends it the newest snapshot there
    is: a busy engine skips versions, it never gets one that was newest long ago. Colocated,
    push() itself writes the engines' copy once every engine is ready.

    Invariant: at most two snapshots live on rank 0, the newest and one in flight. A thread takes
    a snapshot only when its engine is ready, holds it for one send, and push() waits (rarely: a
    send that outlasted a whole step) while a send older than the newest is still in flight."""

    def __init__(self, store, plan, cfg, device, ctls):
        self.plan = plan
        self.cfg = cfg
        self.device = device
        self.ctls = ctls
        self.colocate = cfg["colocate"]
        self.paused = not (self.colocate or staging(cfg))  # then engines are told first
        if self.colocate and device.type == "cpu":  # a new file of ours (O_EXCL: no link)
            fd, path = tempfile.mkstemp(prefix="nanoasync-", dir="/dev/shm")
            os.close(fd)
            store.set("shm", path)
            self.copy = new_copy(plan, cfg, device, path)
        elif self.colocate:  # the workers' copy, shared
            from torch.multiprocessing.reductions import reduce_tensor
            self.copy = new_copy(plan, cfg, device)
            store.set("ipc", pickle.dumps(reduce_tensor(self.copy)))
        store.set("plan", json.dumps(plan))  # last: the workers wait for it
        self.links = [weight_groups(store, e, 0, device, cfg) for e in range(len(ctls))]
        if self.colocate and device.type == "cpu":  # all mapped: none left after a kill -9
            os.unlink(self.copy.untyped_storage().filename)
        self.cond = threading.Condition()
        self.latest = None  # (version, snapshot, the fill's CUDA event); None while filling
        self.stopping = False
        self.sending = {}  # engine -> the version its thread is sending
        self.error = None  # a thread's; Fleet.check_alive raises it between steps
        self.threads = [threading.Thread(target=self.send, args=(e,), daemon=True)
                        for e in range(0 if self.colocate else len(ctls))]
        for t in self.threads:
            t.start()

    def push(self, tensors, version, check_alive=lambda: None):  # (name, tensor) in plan order
        if self.colocate:  # once every engine is ready (loaded the last): write, then tell
            for wake, _ in self.links:
                finish(wake.allreduce([torch.zeros(1, dtype=torch.int64)]), check_alive)
                broadcast_version(wake, version)
            fill(self.copy, self.plan, tensors)
            for _, pg in self.links:
                barrier(pg, self.device)  # all written
            for ctl in self.ctls:
                broadcast_version(ctl, version)
            return
        with self.cond:  # the last snapshot dropped unless in flight; none older in flight
            self.latest, newest = None, self.latest and self.latest[0]
            while any(v != newest for v in self.sending.values()) and not self.error:
                self.cond.wait(0.05)
                check_alive()
        snapshot = new_copy(self.plan, self.cfg, self.device)
        fill(snapshot, self.plan, tensors)
        # a sender's stream waits for this event, not for what the trainer queues after it
        cuda = self.device.type == "cuda"
        filled = torch.cuda.current_stream().record_event() if cuda else None
        with self.cond:
            self.latest = (version, snapshot, filled)
            self.cond.notify_all()

    def send(self, e):  # a thread: engine e's pushes
        wake, pg = self.links[e]
        ctl, sent = self.ctls[e], None
        stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        try:
            while True:
                with self.cond:  # something it has not had, or the end
                    self.cond.wait_for(lambda: self.stopping or self.latest and (
                        self.latest[0] != sent))
                    if self.stopping:
                        return broadcast_version(ctl, -1)
                    announced = self.latest[0]
                if self.paused:  # it receives as it loads: tell it to come
                    broadcast_version(ctl, announced)
                finish(wake.allreduce([torch.zeros(1, dtype=torch.int64)]))  # it is ready
                with self.cond:  # the newest now (push may be filling one: wait for it)
                    self.cond.wait_for(lambda: self.latest)
                    sent, snapshot, filled = self.latest
                    self.sending[e] = sent
                broadcast_version(wake, sent)
                broadcast_copy(pg, snapshot, self.plan, stream, filled)
                snapshot = None  # freeable now: at most two snapshots live
                with self.cond:
                    del self.sending[e]
                    self.cond.notify_all()
                if not self.paused:  # received as it generated: now it loads
                    broadcast_version(ctl, sent)
        except Exception as err:
            node = e // self.cfg.get("rollout_engines", 1)  # engines numbered node by node
            self.error = f"sending weights to rollout process {e} (node {node}) failed: {err}"

    def stop(self, timeout_s):  # -1 to each engine, after its push in flight
        for ctl in self.ctls if self.colocate else ():
            broadcast_version(ctl, -1)
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        for t in self.threads:
            t.join(timeout_s)

    def close(self):  # NCCL's communicators shut down, not hanging
        for t, (_, pg) in zip(self.threads, self.links):  # NCCL: not colocated
            if type(pg).__name__ == "ProcessGroupNCCL":  # abort one stuck sending
                (pg.abort if t.is_alive() else pg.shutdown)()


def fill(flat, plan, tensors):  # (name, tensor) in plan order -> cast into flat
    for o, n, ws in plan:
        for (name, part), (got, t) in zip(weights_in(flat[o:o + n], ws), tensors):
            assert got == name, f"weight order changed: expected {name}, got {got}"
            part.copy_(t.detach())


# ---- in each vLLM worker of an engine (collective_rpc): receiving and loading ----
@dataclasses.dataclass
class Worker:  # a worker's end of the weights, worker.nanoasync: join() makes it
    cfg: dict
    plan: list  # rank 0's: [(offset, numel, [(name, shape)])] a bucket
    device: torch.device
    wake: object  # with rank 0: "ready" (an allreduce), then the version coming (a broadcast)
    weights: object  # with rank 0: the buckets' broadcasts (NCCL on GPUs)
    copy: object  # the flat copy a push lands in as vLLM generates; None: paused
    arrived: queue.Queue = dataclasses.field(default_factory=queue.Queue)  # copy's versions
    loaded: threading.Event = dataclasses.field(default_factory=threading.Event)  # copy read


def join(worker, cfg, e):  # in each vLLM worker of engine e, once
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{torch.cuda.current_device()}" if cuda else "cpu")
    store = open_store(cfg["host"], cfg["rollout_port"], False, cfg["timeout_s"])
    plan = json.loads(store.get("plan"))  # get() waits for it
    copy = None  # paused: none
    if cfg["colocate"] and cuda:  # the trainer's, via CUDA IPC
        fn, args = loads(store.get("ipc"))
        copy = fn(*args)
    elif cfg["colocate"]:  # the trainer's file
        copy = new_copy(plan, cfg, device, store.get("shm").decode())
    elif staging(cfg):
        copy = new_copy(plan, cfg, device)
    wake, weights = weight_groups(store, e, 1 + worker.rank, device, cfg)
    if cfg.get("lora_rank"):  # a zero adapter (the base's outputs) till the first push
        lora.swap(worker, [(n, torch.zeros(shape)) for _, _, ws in plan for n, shape in ws], cfg)
    worker.nanoasync = w = Worker(cfg, plan, device, wake, weights, copy)
    if copy is not None:
        threading.Thread(target=stage, args=(w,), daemon=True).start()


def receive(w):
    """-> the version rank 0 sends next, once we said we are ready (we loaded the last). Its
    buckets: already in the copy (staged, colocated), or still to come (paused: buckets())."""
    w.wake.allreduce([torch.zeros(1, dtype=torch.int64)]).wait()  # ready
    version = broadcast_version(w.wake)  # the newest rank 0 has now
    if w.cfg["colocate"]:
        barrier(w.weights, w.device)  # the trainer wrote it
    elif w.copy is not None:  # on a stream of its own: one no vLLM kernel waits on
        stream = torch.cuda.Stream(w.device) if w.device.type == "cuda" else None
        broadcast_copy(w.weights, w.copy, w.plan, stream)
    return version


def buckets(w):  # paused: a new tensor a bucket (vLLM may keep views) -> (name, weight)
    for _, n, weights in w.plan:
        flat = torch.empty(n, dtype=getattr(torch, w.cfg["rollout_dtype"]), device=w.device)
        w.weights.broadcast(flat, 0).wait()  # on a GPU the stream waits, not the host
        yield from weights_in(flat, weights)


def stage(w):  # a thread a worker: pushes into the copy, one at a time
    try:
        while True:
            w.arrived.put(receive(w))
            w.loaded.wait()  # load() copied it: the next may overwrite it
            w.loaded.clear()
    except Exception as e:  # load() raises it
        w.arrived.put(e)


def load(worker):  # in each vLLM worker, engine paused -> the version
    w, cuda = worker.nanoasync, torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()  # no forward pass reads old weights
    if w.copy is None:  # paused: receive the push itself
        version = receive(w)
        weights = buckets(w)
    else:
        try:
            version = w.arrived.get(timeout=w.cfg["timeout_s"])
        except queue.Empty:
            raise TimeoutError(f"no weights came in timeout_s={w.cfg['timeout_s']} s") from None
        if isinstance(version, Exception):
            raise RuntimeError(f"receiving weights failed: {version}")
        weights = (x for o, n, ws in w.plan for x in weights_in(w.copy[o:o + n], ws))
    if w.cfg.get("lora_rank"):  # only the adapter came
        lora.swap(worker, weights, w.cfg)
    else:
        copy_in(worker, weights)
    if cuda:
        torch.cuda.synchronize()  # all streams see the new weights
    w.loaded.set()
    return version


def copy_in(worker, weights):  # (name, tensor) into vLLM's weights, in place
    from vllm.config import set_current_vllm_config
    with set_current_vllm_config(worker.vllm_config):  # as vLLM's own reloads
        worker.model_runner.reload_weights(weights_iterator=weights)
    model = worker.model_runner.get_model()
    if not torch.cuda.is_available() and getattr(model.config, "tie_word_embeddings", False):
        # the CPU backend pre-packs lm_head: redo it from the tied weight
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
        dispatch_cpu_unquantized_gemm(model.lm_head, remove_weight=False)
