"""sync.py: the trainer <-> rollout engine wires, set up by a TCPStore on trainer rank 0 (which also
holds the bucket plan and rollout.py's admission counters). Gloo: ctl announces each new version,
traj brings back groups and evals. Weights go from trainer rank 0 to each vLLM worker by NCCL (gloo
on CPU) through two bucket buffers a side; colocated, the buffers are shared (CUDA IPC, /dev/shm)
and gloo only signals. Simplifications: a fixed weight layout; buckets cut at tensor boundaries."""
import math
import os
import pickle
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def open_store(host, port, master, timeout_s):  # on trainer rank 0's machine (MASTER_ADDR)
    try:
        return dist.TCPStore(host, port, is_master=master, wait_for_workers=False,
                             timeout=timedelta(seconds=timeout_s))
    except (RuntimeError, OSError) as e:
        raise RuntimeError(f"cannot open the trainer<->rollout store on {host}:{port} ({e}); "
                           "port in use? pick a free one with --rollout_port=PORT") from None


def wait_for(store, keys, timeout_s, check_alive=lambda: None):
    deadline = time.time() + timeout_s
    while not store.check(keys):
        check_alive()
        if time.time() > deadline:
            raise TimeoutError(f"the rollout side did not set {keys} in timeout_s={timeout_s} s")
        time.sleep(0.1)


def gloo(store, name, rank, size, timeout_s):
    return dist.ProcessGroupGloo(dist.PrefixStore(name, store), rank, size,
                                 timedelta(seconds=timeout_s))


def connect(store, rank, engines, timeout_s):  # rank 0: the trainer; rank 1 + e: engine e
    # an engine waits on ctl as long as a step takes; a dead trainer breaks it anyway
    ctl = gloo(store, "ctl", rank, 1 + engines, timeout_s if rank == 0 else 7 * 86400)
    if rank == 0:
        return ctl, [gloo(store, f"traj{e}", 0, 2, timeout_s) for e in range(engines)]
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


def announce(ctl, version):  # to every engine: the weights of `version` follow; -1: stop
    ctl.broadcast(torch.tensor([version]), 0).wait()


def announced(ctl):
    v = torch.zeros(1, dtype=torch.int64)
    ctl.broadcast(v, 0).wait()
    return int(v)


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


def shm_path(port, i):
    return f"/dev/shm/nanoasync-{port}-{i}"


def _buffers(buckets, cfg, device, port):
    size, dtype = max(map(numel, buckets)), getattr(torch, cfg["rollout_dtype"])
    if cfg["colocate"] and device.type == "cpu":
        return [torch.from_file(shm_path(port, i), shared=True, size=size, dtype=dtype)
                for i in (0, 1)]
    return [torch.empty(size, dtype=dtype, device=device) for _ in (0, 1)]


def weight_group(store, rank, world, device, colocate, timeout_s):
    if device.type == "cuda" and not colocate:
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timedelta(seconds=timeout_s)
        pg = dist.ProcessGroupNCCL(dist.PrefixStore("weights", store), rank, world, opts)
        pg.eager_connect_single_device(device)  # every member connects now, not in the first push
        return pg
    pg = gloo(store, "weights", rank, world, timeout_s)
    if colocate:
        barrier(pg, device)  # every side has mapped the buffers
    return pg


def barrier(pg, device):
    if device.type == "cuda":
        torch.cuda.current_stream().synchronize()  # other processes see only completed work
    pg.allreduce([torch.zeros(1)]).wait()


class Sender:  # trainer rank 0's end of the weight group
    def __init__(self, store, buckets, cfg, device, workers):
        self.buckets, self.device, self.colocate = buckets, device, cfg["colocate"]
        store.set("plan", pickle.dumps(buckets))
        self.bufs = _buffers(buckets, cfg, device, cfg["rollout_port"])
        if self.colocate and device.type == "cuda":
            from torch.multiprocessing.reductions import reduce_tensor
            store.set("ipc", pickle.dumps([reduce_tensor(b) for b in self.bufs]))
        store.set("weights_ready", "1")
        self.pg = weight_group(store, 0, 1 + workers, device, self.colocate, cfg["timeout_s"])
        if self.colocate and device.type == "cpu":
            for i in (0, 1):  # all mapped: leave nothing in /dev/shm, even after a kill -9
                os.unlink(shm_path(cfg["rollout_port"], i))
        self.bytes = sum(map(numel, buckets)) * self.bufs[0].element_size()


def push(sender, tensors, buckets, check_alive=lambda: None):
    """Every trainer rank calls this (gathers are collectives); only rank 0 passes a Sender."""
    it, works = iter(tensors), []
    for k, bucket in enumerate(buckets):
        full = [next(it) for _ in bucket]
        for (name, *_), (got, _) in zip(bucket, full):
            assert got == name, f"weight order changed: expected {name}, got {got}"
        if sender is None:
            continue
        if len(works) >= 2:
            works[-2].wait()  # this buffer is free again; NCCL: the stream waits, not the host
        flat = sender.bufs[k % 2]
        for (_, _, off, n), (_, t) in zip(bucket, full):
            flat[off:off + n].copy_(t.detach().reshape(-1))
        if sender.colocate:
            barrier(sender.pg, sender.device)  # bucket k is in place, k - 1 is read
        else:
            works.append(sender.pg.broadcast(flat[:numel(bucket)], 0))
    if sender is None:
        return 0
    for w in works:
        w.wait()
    if sender.colocate:
        barrier(sender.pg, sender.device)  # the last bucket is read
    while True:  # NCCL: spin on the host until the last bucket is out, to see a dead engine
        check_alive()
        if not works or works[-1].is_completed():
            return sender.bytes
        time.sleep(0.001)


def join(worker, cfg, first_rank):  # in each vLLM worker (collective_rpc)
    cuda, colocate, port = torch.cuda.is_available(), cfg["colocate"], cfg["rollout_port"]
    device = torch.device(f"cuda:{torch.cuda.current_device()}" if cuda else "cpu")
    store = open_store(cfg["host"], port, False, cfg["timeout_s"])
    store.wait(["weights_ready"])
    buckets = pickle.loads(store.get("plan"))
    if colocate and cuda:  # CUDA IPC: open the trainer's buffers
        bufs = [fn(*args) for fn, args in pickle.loads(store.get("ipc"))]
    else:
        bufs = _buffers(buckets, cfg, device, port)
    world = 1 + cfg["engines"] * cfg["tensor_parallel_size"]
    pg = weight_group(store, first_rank + worker.rank, world, device, colocate, cfg["timeout_s"])
    worker.nanoasync = dict(store=store, pg=pg, bufs=bufs, buckets=buckets, device=device,
                            colocate=colocate)


def _receive(store, pg, bufs, buckets, device, colocate):  # bucket k + 1 comes while vLLM loads k
    works = {}

    def post(k):  # NCCL: queued on our stream behind the clones out of this buffer
        if k < len(buckets) and not colocate:
            works[k] = pg.broadcast(bufs[k % 2][:numel(buckets[k])], 0)

    post(0)
    for k, bucket in enumerate(buckets):
        if colocate:
            barrier(pg, device)  # bucket k is in place; we are done with k - 1
        else:
            works.pop(k).wait()
        flat = bufs[k % 2]
        # clones: vLLM may keep a tensor until its layer is complete, after this buffer refills
        tensors = [(name, flat[off:off + n].view(shape).clone()) for name, shape, off, n in bucket]
        post(k + 1)
        yield from tensors


def load(worker):
    from vllm.config import set_current_vllm_config
    s = worker.nanoasync
    cuda = s["device"].type == "cuda"
    if cuda:
        torch.cuda.synchronize()  # no forward pass still reads the old weights
    with set_current_vllm_config(worker.vllm_config):  # as vLLM's own reloads (quantized layers)
        worker.model_runner.reload_weights(weights_iterator=_receive(**s))
    model = worker.model_runner.get_model()
    if not cuda and getattr(model.config, "tie_word_embeddings", False):
        # the CPU backend pre-packs lm_head for its GEMM: re-pack it from the new tied weight
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
        dispatch_cpu_unquantized_gemm(model.lm_head, remove_weight=False)
    if s["colocate"]:
        barrier(s["pg"], s["device"])
    elif cuda:
        torch.cuda.synchronize()  # every stream sees the new weights
