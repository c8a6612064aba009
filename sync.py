"""sync.py: the trainer <-> rollout engine wires, set up by a TCPStore on trainer rank 0 (which also
holds the bucket plan and the admission counters, rollout.Budget). Gloo: ctl tells the engines
each version to load, traj brings back groups and evals. Weights go from trainer rank 0 to a thread
in each vLLM worker that receives them into a staging copy while the engine goes on generating
(NCCL on GPU, gloo on CPU; colocated, the staging copy is shared memory, CUDA IPC or /dev/shm, and
gloo only signals); the engine then pauses only to copy it into vLLM's weights (load).
Simplifications: a fixed weight layout; buckets cut at tensor boundaries; one staging copy."""
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
    """Thread: adds 1 to `key` in the store every BEAT_S and runs every(store); if trainer rank 0's
    store is gone or silent for DEAD_S (rank 0 died, its node is lost), ends the process."""
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


def wait_for(store, keys, timeout_s, check_alive=lambda: None):
    deadline = time.time() + timeout_s
    while not store.check(keys):
        check_alive()
        if time.time() > deadline:
            raise TimeoutError(f"the rollout side did not set {keys} in {timeout_s} s")
        time.sleep(0.1)


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


def announce(pg, version):  # ctl: to every engine, load `version` (its weights are out); -1: stop
    pg.broadcast(torch.tensor([version]), 0).wait()


def announced(pg):
    v = torch.zeros(1, dtype=torch.int64)
    pg.broadcast(v, 0).wait()
    return int(v)


def finish(work, check_alive=lambda: None):  # NCCL's wait() only gates a stream: poll the host
    while not work.is_completed():
        check_alive()
        time.sleep(0.005)
    work.wait()  # raises its error, if it failed


def plan_buckets(meta, bucket_mb, dtype):  # [(name, shape)] -> [[(name, shape, offset, numel)]]
    limit, buckets, used = int(bucket_mb * 2**20) // dtype.itemsize, [], 0
    for name, shape in meta:
        n = math.prod(shape)
        if not buckets or used + n > limit:
            buckets.append([])
            used = 0
        buckets[-1].append((name, tuple(shape), used, n))
        used += n
    return buckets


def numel(bucket):
    return sum(n for *_, n in bucket)


def spans(buckets):  # each bucket's place in the staging copy
    ends = [sum(map(numel, buckets[:k + 1])) for k in range(len(buckets))]
    return [(end - numel(b), end) for b, end in zip(buckets, ends)]


def staging(buckets, cfg, device):  # a flat copy of every weight; colocated on CPU, in /dev/shm
    size, dtype = sum(map(numel, buckets)), getattr(torch, cfg["rollout_dtype"])
    if cfg["colocate"] and device.type == "cpu":
        return torch.from_file(shm_path(cfg["rollout_port"]), shared=True, size=size, dtype=dtype)
    return torch.empty(size, dtype=dtype, device=device)


def shm_path(port):
    return f"/dev/shm/nanoasync-{port}"


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
    def __init__(self, store, buckets, cfg, device, workers):
        self.buckets, self.device, self.colocate = buckets, device, cfg["colocate"]
        store.set("plan", pickle.dumps(buckets))
        if self.colocate:  # the workers' staging copy itself
            self.bufs = [staging(buckets, cfg, device)]
            if device.type == "cuda":
                from torch.multiprocessing.reductions import reduce_tensor
                store.set("ipc", pickle.dumps(reduce_tensor(self.bufs[0])))
        else:  # two bucket buffers: one is filled while the other is on the wire
            dtype = getattr(torch, cfg["rollout_dtype"])
            self.bufs = [torch.empty(max(map(numel, buckets)), dtype=dtype, device=device)
                         for _ in (0, 1)]
        store.set("weights_ready", "1")
        self.wake, self.pg = weight_groups(store, 0, 1 + workers, device, self.colocate,
                                           cfg["timeout_s"])
        if self.colocate and device.type == "cpu":  # all mapped: nothing left, even after kill -9
            os.unlink(shm_path(cfg["rollout_port"]))
        self.bytes = sum(map(numel, buckets)) * self.bufs[0].element_size()


def push(sender, tensors, buckets, version=0, check_alive=lambda: None):
    """Every trainer rank calls this (gathers are collectives); only rank 0 passes a Sender. The
    workers receive it while their engines generate; train.py then announces it (ctl)."""
    it, works = iter(tensors), []
    if sender is not None:  # the version to every worker, once its engine has loaded the last
        finish(sender.wake.allreduce([torch.tensor([version])]), check_alive)
    for k, (bucket, (start, end)) in enumerate(zip(buckets, spans(buckets))):
        full = [next(it) for _ in bucket]
        for (name, *_), (got, _) in zip(bucket, full):
            assert got == name, f"weight order changed: expected {name}, got {got}"
        if sender is None:
            continue
        if sender.colocate:
            flat = sender.bufs[0][start:end]
        else:
            if len(works) >= 2:
                works[-2].wait()  # this buffer is free again; NCCL: the stream waits, not the host
            flat = sender.bufs[k % 2]
        for (_, _, off, n), (_, t) in zip(bucket, full):
            flat[off:off + n].copy_(t.detach().reshape(-1))
        if not sender.colocate:
            works.append(sender.pg.broadcast(flat[:end - start], 0))
    if sender is None:
        return 0
    if sender.colocate:
        barrier(sender.pg, sender.device)  # all of it is in place
    for w in works:
        finish(w, check_alive)
    return sender.bytes


def join(worker, cfg, first_rank):  # in each vLLM worker (collective_rpc): start receiving
    cuda, port = torch.cuda.is_available(), cfg["rollout_port"]
    device = torch.device(f"cuda:{torch.cuda.current_device()}" if cuda else "cpu")
    store = open_store(cfg["host"], port, False, cfg["timeout_s"])
    store.wait(["weights_ready"])
    buckets = pickle.loads(store.get("plan"))
    if cfg["colocate"] and cuda:  # CUDA IPC: open the trainer's
        fn, args = pickle.loads(store.get("ipc"))
        copy = fn(*args)
    else:
        copy = staging(buckets, cfg, device)
    world = 1 + cfg["engines"] * cfg["tensor_parallel_size"]
    groups = weight_groups(store, first_rank + worker.rank, world, device, cfg["colocate"],
                           cfg["timeout_s"])
    worker.nanoasync = s = dict(copy=copy, buckets=buckets, device=device, staged=queue.Queue(),
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
        works = [pg.broadcast(s["copy"][a:b], 0) for a, b in spans(s["buckets"])]
    for w in works:
        finish(w)
    return int(version)


def stage(s):
    """Thread in each worker: push after push into the staging copy, beside vLLM's forward passes;
    on a GPU on a stream of its own, never waited on: it gates none of vLLM's kernels. Not with
    tensor_parallel_size > 1 on GPUs: NCCL does not promise that two communicators' kernels at once
    (ours, vLLM's all-reduces) cannot deadlock; there load() receives, the engine paused."""
    try:
        while True:
            s["staged"].put(receive(s))
            s["loaded"].wait()  # load() has copied it: the next push may overwrite it
            s["loaded"].clear()
    except Exception as e:  # load() raises it
        s["staged"].put(e)


def load(worker):  # in each vLLM worker (collective_rpc): the engine's pause -> the version
    s = worker.nanoasync
    if s["inline"]:
        torch.cuda.synchronize()  # no forward pass (nor vLLM's all-reduces) runs meanwhile
        s["staged"].put(receive(s))
    try:
        version = s["staged"].get(timeout=s["timeout_s"])
    except queue.Empty:
        raise TimeoutError(f"no weights came in timeout_s={s['timeout_s']} s") from None
    if isinstance(version, Exception):
        raise RuntimeError(f"receiving weights failed: {version}")
    cuda, buckets = s["device"].type == "cuda", s["buckets"]
    if cuda:
        torch.cuda.synchronize()  # no forward pass still reads the old weights
    copy_in(worker, ((name, s["copy"][a + off:a + off + n].view(shape))
                     for b, (a, _) in zip(buckets, spans(buckets)) for name, shape, off, n in b))
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
