"""sync.py: the trainer <-> rollout engine wires, set up by a TCPStore on trainer rank 0 (also the
heartbeats, the weights' plan, budget.py's discards). Gloo: ctl tells the engines each version to
load, traj brings back groups and evals. The weights go from trainer rank 0 to a thread in each
vLLM worker, into a staging copy while the engine generates (NCCL on GPU, gloo on CPU; colocated,
it is shared memory, CUDA IPC or /dev/shm); the engine pauses only to copy it in (load).
Simplifications: a fixed weight layout; a broadcast per tensor; one staging copy."""
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
BEAT_S, DEAD_S = 1, 10  # a heartbeat a second; a peer silent for DEAD_S is dead


def open_store(host, port, master, timeout_s):  # on trainer rank 0's machine (MASTER_ADDR)
    try:
        return dist.TCPStore(host, port, is_master=master, wait_for_workers=False,
                             timeout=timedelta(seconds=timeout_s))
    except (RuntimeError, OSError) as e:
        raise RuntimeError(f"cannot open the trainer<->rollout store on {host}:{port} ({e}); "
                           "port in use? pick a free one with --rollout_port=PORT") from None


def heartbeat(host, port, key, who, every=lambda store: None, first_s=DEAD_S):
    """Thread: `key` += 1 each BEAT_S, every(store); rank 0's store gone or silent: exit at once."""
    def run():
        try:
            store = open_store(host, port, False, first_s)
            store.set_timeout(timedelta(seconds=DEAD_S))
            while True:
                store.add(key, 1)
                every(store)
                time.sleep(BEAT_S)
        except Exception as e:
            print(f"error: {who}: trainer rank 0's store on {host}:{port} is gone ({e})",
                  file=sys.stderr, flush=True)
            os._exit(1)  # at once: nothing waits on a dead peer (NCCL would, for its timeout)
    threading.Thread(target=run, daemon=True).start()


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


def announce(pg, version=0):  # ctl: trainer rank 0 tells every engine the version to load (-1:
    v = torch.tensor([version])  # stop); -> what the engines receive
    pg.broadcast(v, 0).wait()
    return int(v)


def finish(work, check_alive=lambda: None):  # NCCL's wait() only gates a stream: poll the host
    while not work.is_completed():
        check_alive()
        time.sleep(0.005)
    work.wait()  # raises its error, if it failed


def plan(meta):  # [(name, shape)] -> [(name, shape, offset, numel)] in one flat staging copy
    numels = [math.prod(shape) for _, shape in meta]
    return [(name, tuple(shape), offset, n) for (name, shape), offset, n
            in zip(meta, itertools.accumulate([0] + numels), numels)]


def staging(plan, cfg, device):  # a flat copy of every weight; colocated on CPU, in /dev/shm
    size, dtype = sum(n for *_, n in plan), getattr(torch, cfg["rollout_dtype"])
    if cfg["colocate"] and device.type == "cpu":
        path = f"/dev/shm/nanoasync-{cfg['rollout_port']}"  # Sender unlinks it once all mapped
        return torch.from_file(path, shared=True, size=size, dtype=dtype)
    return torch.empty(size, dtype=dtype, device=device)


def weight_groups(store, rank, world, device, colocate, timeout_s):
    """-> (wake: gloo, a push begins; the weights: NCCL on GPU, else gloo)."""
    wake = gloo(store, "wake", rank, world, timeout_s if rank == 0 else FOREVER)
    if device.type == "cuda" and not colocate:
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timedelta(seconds=timeout_s)
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
        store.set("plan", pickle.dumps(plan))  # last: the workers wait for it
        self.wake, self.pg = weight_groups(store, 0, 1 + workers, device, self.colocate,
                                           cfg["timeout_s"])
        if self.colocate and device.type == "cpu":  # all mapped: nothing left, even after kill -9
            os.unlink(self.copy.untyped_storage().filename)


def push(sender, tensors, plan, version=0, check_alive=lambda: None):
    """Every trainer rank calls it (gathers are collectives); rank 0 alone passes a Sender."""
    works = []
    if sender is not None:  # the version to every worker, once its engine has loaded the last
        finish(sender.wake.allreduce([torch.tensor([version])]), check_alive)
    for (name, _, off, n), (got, t) in zip(plan, tensors):
        assert got == name, f"weight order changed: expected {name}, got {got}"
        if sender is None:
            continue
        t = t.detach().to(sender.dtype).reshape(-1)
        if sender.colocate:
            sender.copy[off:off + n].copy_(t)
        else:  # a tensor at a time: its send overlaps the next ones' gathers; 8 in flight
            works.append(sender.pg.broadcast(t, 0))
            if len(works) > 8:
                finish(works[-9], check_alive)
    if sender is not None and sender.colocate:
        barrier(sender.pg, sender.device)  # all of it is in place
    for w in works:
        finish(w, check_alive)


def join(worker, cfg, first_rank):  # in each vLLM worker (collective_rpc): start receiving
    cuda, port = torch.cuda.is_available(), cfg["rollout_port"]
    device = torch.device(f"cuda:{torch.cuda.current_device()}" if cuda else "cpu")
    store = open_store(cfg["host"], port, False, cfg["timeout_s"])
    store.wait(["plan"])
    plan = pickle.loads(store.get("plan"))
    if cfg["colocate"] and cuda:  # CUDA IPC: open the trainer's
        fn, args = pickle.loads(store.get("ipc"))
        copy = fn(*args)
    else:
        copy = staging(plan, cfg, device)
    world = 1 + cfg["engines"] * cfg["tensor_parallel_size"]
    groups = weight_groups(store, first_rank + worker.rank, world, device, cfg["colocate"],
                           cfg["timeout_s"])
    worker.nanoasync = s = dict(copy=copy, plan=plan, device=device, staged=queue.Queue(),
                                loaded=threading.Event(), timeout_s=cfg["timeout_s"],
                                groups=groups, colocate=cfg["colocate"],
                                inline=cuda and cfg["tensor_parallel_size"] > 1)
    if not s["inline"]:
        threading.Thread(target=stage, args=(s,), daemon=True).start()


def receive(s):  # one push into the staging copy -> its version
    if s["device"].type == "cuda":
        torch.cuda.set_device(s["device"])  # a new thread starts on GPU 0
    wake, pg = s["groups"]
    version = torch.zeros(1, dtype=torch.int64)
    wake.allreduce([version]).wait()  # a push begins: the trainer's version, 0s from us
    if s["colocate"]:
        barrier(pg, s["device"])  # the trainer has written it
        return int(version)
    stream = torch.cuda.Stream(s["device"]) if s["device"].type == "cuda" else None
    with torch.cuda.stream(stream):  # None (CPU): a no-op
        works = [pg.broadcast(s["copy"][off:off + n], 0) for *_, off, n in s["plan"]]
    for w in works:
        finish(w)
    return int(version)


def stage(s):
    """Thread in each worker: each push into the staging copy beside vLLM's forward passes, on a
    stream no kernel of vLLM's waits on. Not with tensor_parallel_size > 1 on GPUs (NCCL does not
    promise two communicators at once cannot deadlock): load() receives there, the engine paused."""
    try:
        while True:
            s["staged"].put(receive(s))
            s["loaded"].wait()  # load() has copied it: the next push may overwrite it
            s["loaded"].clear()
    except Exception as e:  # load() raises it
        s["staged"].put(e)


def load(worker):  # in each vLLM worker (collective_rpc): the engine's pause, a copy -> version
    s, cuda = worker.nanoasync, torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()  # no forward pass reads the old weights (nor all-reduces run)
    try:
        version = receive(s) if s["inline"] else s["staged"].get(timeout=s["timeout_s"])
    except queue.Empty:
        raise TimeoutError(f"no weights came in timeout_s={s['timeout_s']} s") from None
    if isinstance(version, Exception):
        raise RuntimeError(f"receiving weights failed: {version}")
    copy_in(worker, ((name, s["copy"][off:off + n].view(shape)) for name, shape, off, n in
                     s["plan"]))
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
