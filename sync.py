"""
sync.py: the wires between the trainer and the rollout engines, all on one TCPStore hosted by trainer rank 0.

  ctl      trainer rank 0 -> every rollout process: a header [version, has_weights, stop] after each optimizer
           step. gloo, CPU tensors, always: a control message never touches a CUDA stream.
  traj     rollout process e -> trainer rank 0: finished groups and eval results, pickled. One 2-rank gloo group
           per engine, each read by its own trainer thread.
  weights  trainer rank 0 -> every vLLM worker of every engine. Rank 0 is the trainer, engine e's worker t is
           rank 1 + e * tensor_parallel_size + t. Each worker receives inside its own process (load(), run by
           vLLM's collective_rpc), on its current stream, and hands the tensors to vLLM's reload, whose loaders
           take the slice that worker needs. NCCL on GPU, gloo on CPU.
           Buckets go out and are loaded one after another through two bucket-sized buffers on each side, so
           neither side ever holds a second copy of the model.
           colocate: trainer and vLLM share the device, so the two buffers are shared instead (CUDA IPC on GPU,
           /dev/shm on CPU) and the group (gloo) only says "bucket k is in buffer k % 2, and k - 1 is read".
The store also holds small values every side reads: the bucket plan, the IPC handles, the shared admission
counters (rollout.py).

Simplifications: the weight layout (names, shapes, dtype) is fixed for the run; buckets are cut at tensor
boundaries (a tensor larger than bucket_mb gets a bucket of its own); trajectories are pickled (token ids and
floats), weights never are.
"""
import math
import os
import pickle
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def open_store(host, port, master, timeout_s):
    try:
        return dist.TCPStore(host, port, is_master=master, timeout=timedelta(seconds=timeout_s),
                             wait_for_workers=False)
    except (RuntimeError, OSError) as e:
        raise RuntimeError(f"cannot open the trainer<->rollout store on {host}:{port} ({e}); if the port is "
                           "in use, pick a free one with --rollout_port=PORT") from None


def wait_for(store, keys, timeout_s, check_alive=lambda: None):
    """Wait until every key is set, calling check_alive() meanwhile so that a peer that died is reported at once."""
    deadline = time.time() + timeout_s
    while not store.check(keys):
        check_alive()
        if time.time() > deadline:
            raise TimeoutError(f"the rollout side did not set {keys} within timeout_s={timeout_s} s")
        time.sleep(0.1)


def gloo(store, name, rank, size, timeout_s):
    return dist.ProcessGroupGloo(dist.PrefixStore(name, store), rank, size, timedelta(seconds=timeout_s))


def connect(store, rank, engines, timeout_s):
    """The control and trajectory groups. rank 0: trainer (-> ctl, [traj per engine]); rank 1 + e: engine e's
    rollout process (-> ctl, traj). Every side builds them in the same order."""
    ctl = gloo(store, "ctl", rank, 1 + engines, timeout_s)
    if rank == 0:
        return ctl, [gloo(store, f"traj{e}", 0, 2, timeout_s) for e in range(engines)]
    return ctl, gloo(store, f"traj{rank - 1}", 1, 2, timeout_s)


# ---- small messages -------------------------------------------------------------------------------------------

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


def send_header(ctl, version, has_weights=False, stop=False):
    ctl.broadcast(torch.tensor([version, int(has_weights), int(stop)]), 0).wait()


def recv_header(ctl):
    h = torch.zeros(3, dtype=torch.int64)
    ctl.broadcast(h, 0).wait()
    version, has_weights, stop = h.tolist()
    return version, bool(has_weights), bool(stop)


# ---- weights --------------------------------------------------------------------------------------------------

def plan_buckets(meta, bucket_mb, dtype):
    """meta: [(name, shape)] in send order -> buckets, each a list of (name, shape, offset, numel)."""
    limit = int(bucket_mb * 2**20) // torch.empty(0, dtype=dtype).element_size()  # in elements
    buckets, cur, used = [], [], 0
    for name, shape in meta:
        n = math.prod(shape)
        if cur and used + n > limit:
            buckets.append(cur)
            cur, used = [], 0
        cur.append((name, tuple(shape), used, n))
        used += n
    if cur:
        buckets.append(cur)
    return buckets


def bucket_numel(buckets):
    return max(sum(n for *_, n in b) for b in buckets)


def shm_path(port, i):
    return f"/dev/shm/nanoasync-{port}-{i}"


def weight_group(store, rank, world, device, colocate, timeout_s):
    if device.type == "cuda" and not colocate:
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timedelta(seconds=timeout_s)
        return dist.ProcessGroupNCCL(dist.PrefixStore("weights", store), rank, world, opts)
    return gloo(store, "weights", rank, world, timeout_s)


def barrier(pg, device):
    """Everything this side did to a shared buffer is done; then wait for every other side."""
    if device.type == "cuda":
        torch.cuda.current_stream().synchronize()  # another process reads it: stream order does not reach there
    pg.allreduce([torch.zeros(1)]).wait()


class Sender:
    """Trainer rank 0's end of the weight group. Holds the group and the two bucket buffers for the run."""

    def __init__(self, store, buckets, cfg, device, workers):
        """buckets: plan_buckets() of the model, in cfg["rollout_dtype"]; the workers read it from the store."""
        self.dtype, self.device, self.colocate = getattr(torch, cfg["rollout_dtype"]), device, cfg["colocate"]
        self.buckets = buckets
        store.set("plan", pickle.dumps(buckets))
        n = bucket_numel(self.buckets)
        if self.colocate and device.type == "cpu":
            port = cfg["rollout_port"]
            self.bufs = [torch.from_file(shm_path(port, i), shared=True, size=n, dtype=self.dtype) for i in (0, 1)]
        else:
            self.bufs = [torch.empty(n, dtype=self.dtype, device=device) for _ in (0, 1)]
        if self.colocate and device.type == "cuda":  # handles to this process's buffers, opened by the worker
            from torch.multiprocessing.reductions import reduce_tensor
            store.set("ipc", pickle.dumps([reduce_tensor(b) for b in self.bufs]))
        store.set("weights_ready", "1")
        self.pg = weight_group(store, 0, 1 + workers, device, self.colocate, cfg["timeout_s"])
        if device.type == "cuda" and not self.colocate:
            self.pg.eager_connect_single_device(device)  # every worker joins now, not in the first push
        if self.colocate:
            barrier(self.pg, device)  # every worker has mapped the buffers ...
            if device.type == "cpu":
                for i in (0, 1):  # ... so their names can go: nothing is left in /dev/shm, even after a kill -9
                    os.unlink(shm_path(cfg["rollout_port"], i))
        self.bytes = sum(n for b in self.buckets for *_, n in b) * self.bufs[0].element_size()


def push(sender, tensors, buckets, check_alive=lambda: None):
    """Send the model, bucket by bucket, while the next bucket is gathered and packed. Every trainer rank calls
    this with the same `tensors` iterator of (name, full tensor) (gathering a sharded tensor is a collective);
    only rank 0 passes a Sender. Returns the bytes sent."""
    it, works = iter(tensors), []
    for k, bucket in enumerate(buckets):
        full = []
        for name, shape, off, n in bucket:
            got, t = next(it)
            assert got == name, f"weight order changed: expected {name}, got {got}"
            full.append(t)
        if sender is None:
            continue
        if len(works) >= 2:
            works[-2].wait()  # the broadcast two buckets ago read this buffer; NCCL: the stream waits, not us
        flat = sender.bufs[k % 2]
        for (name, shape, off, n), t in zip(bucket, full):
            flat[off:off + n].copy_(t.detach().reshape(-1))
        if sender.colocate:
            barrier(sender.pg, sender.device)  # bucket k is in place, and the workers have read bucket k - 1
        else:
            works.append(sender.pg.broadcast(flat[:off + n], 0))
    if sender is None:
        return 0
    for w in works:
        w.wait()
    if sender.colocate:
        barrier(sender.pg, sender.device)  # the last bucket is read: the buffers may be refilled
    while works and not works[-1].is_completed():  # NCCL: the host waits here, and notices a dead engine
        check_alive()
        time.sleep(0.001)
    return sender.bytes


# ---- inside each vLLM worker (collective_rpc) -------------------------------------------------------------------

def join(worker, host, port, first_rank, world, cfg):
    """Become rank first_rank + (this worker's rank in its engine) of the weight group; keep what load() needs
    on the worker."""
    rank = first_rank + worker.rank
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    store = open_store(host, port, False, cfg["timeout_s"])
    store.wait(["weights_ready"])
    buckets, dtype = pickle.loads(store.get("plan")), getattr(torch, cfg["rollout_dtype"])
    n = bucket_numel(buckets)
    if cfg["colocate"] and device.type == "cuda":
        bufs = [fn(*args) for fn, args in pickle.loads(store.get("ipc"))]
    elif cfg["colocate"]:
        bufs = [torch.from_file(shm_path(port, i), shared=True, size=n, dtype=dtype) for i in (0, 1)]
    else:
        bufs = [torch.empty(n, dtype=dtype, device=device) for _ in (0, 1)]
    pg = weight_group(store, rank, world, device, cfg["colocate"], cfg["timeout_s"])
    if device.type == "cuda" and not cfg["colocate"]:
        pg.eager_connect_single_device(device)
    if cfg["colocate"]:
        barrier(pg, device)
    worker.nanoasync = dict(store=store, pg=pg, bufs=bufs, buckets=buckets, device=device, colocate=cfg["colocate"])


def _receive(s):
    """Yield the model's tensors, bucket by bucket: bucket k + 1 is on its way while vLLM loads bucket k."""
    buckets, works = s["buckets"], {}

    def post(k):  # NCCL: queued on our stream, behind the copies out of this buffer's previous bucket
        if k < len(buckets) and not s["colocate"]:
            *_, (_, _, off, n) = buckets[k]
            works[k] = s["pg"].broadcast(s["bufs"][k % 2][:off + n], 0)

    post(0)
    for k, bucket in enumerate(buckets):
        flat = s["bufs"][k % 2]
        if s["colocate"]:
            barrier(s["pg"], s["device"])  # bucket k is in place; we are done with k - 1
        else:
            works.pop(k).wait()  # NCCL: our stream waits for the data, in stream order
        # copies: vLLM's reload holds each tensor until the layer it belongs to is complete, which may be after
        # this buffer is refilled; it frees them layer by layer
        tensors = [(name, flat[off:off + n].view(shape).clone()) for name, shape, off, n in bucket]
        post(k + 1)
        yield from tensors


def load(worker):
    """Receive the model bucket by bucket and reload it in place with vLLM's own post-load processing."""
    s = worker.nanoasync
    if s["device"].type == "cuda":
        torch.cuda.synchronize()  # no forward pass is still reading the weights about to be overwritten
    worker.model_runner.reload_weights(weights_iterator=_receive(s))
    model = worker.model_runner.get_model()
    if s["device"].type == "cpu" and getattr(model.config, "tie_word_embeddings", False):
        # the CPU backend packs the output layer for its GEMM; re-pack it from the freshly loaded tied weight
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
        dispatch_cpu_unquantized_gemm(model.lm_head, remove_weight=False)
    if s["colocate"]:
        barrier(s["pg"], s["device"])
    elif s["device"].type == "cuda":
        torch.cuda.synchronize()  # every stream of this worker sees the new weights
