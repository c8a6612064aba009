"""
sync.py: the wire between trainer rank 0 and the rollout process.

Two standalone torch.distributed groups of size 2 (rank 0 = trainer, rank 1 = rollout) on one TCPStore:
  "ctl"  trainer -> rollout: a small header [version, groups_discarded, has_weights, stop] after every optimizer step
         (and whenever the buffer discards a group, so the rollout can replace it), followed by the weights as a few
         flat buckets when has_weights is set.
  "traj" rollout -> trainer: finished groups and eval results as pickled objects.
One group per direction, so the two threads that drive them never have to agree on an order of collectives.
The backend follows the device (gloo on CPU, NCCL on GPU); only the group constructor differs.

Simplifications: the weight layout (names, shapes, dtype) is sent once at start-up and is fixed for the run; buckets
are cut along tensor boundaries (a tensor larger than bucket_mb gets a bucket of its own); trajectories are pickled
(they are small: token ids and floats), weights are never pickled.
"""
import math
import pickle
import time
from datetime import timedelta

import torch
import torch.distributed as dist

HEADER = 4  # [version, groups_discarded, has_weights, stop]


def connect(host, port, rank, device, timeout_s, check_alive=lambda: None):
    """Open both groups; rank 0 (the trainer) hosts the store and, while it waits for the rollout process to join,
    calls check_alive() so a peer that died during start-up is reported at once. Returns (ctl, traj, store)."""
    timeout = timedelta(seconds=timeout_s)
    try:
        store = dist.TCPStore(host, port, world_size=2, is_master=(rank == 0), timeout=timeout, wait_for_workers=False)
    except (RuntimeError, OSError) as e:
        raise RuntimeError(f"cannot open the trainer<->rollout store on {host}:{port} ({e}); if the port is in use, "
                           f"pick a free one with --rollout_port=PORT") from None
    if rank == 1:
        store.set("rollout_joined", "1")
    deadline = time.time() + timeout_s
    while rank == 0 and not store.check(["rollout_joined"]):
        check_alive()
        if time.time() > deadline:
            raise TimeoutError(f"the rollout process did not connect within timeout_s={timeout_s} s")
        time.sleep(0.2)
    groups = []
    for name in ("ctl", "traj"):
        prefix = dist.PrefixStore(name, store)
        if str(device).startswith("cuda"):
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            groups.append(dist.ProcessGroupNCCL(prefix, rank, 2, opts))
        else:
            groups.append(dist.ProcessGroupGloo(prefix, rank, 2, timeout))
    return groups[0], groups[1], store  # the caller keeps the store alive as long as the groups


# ---- objects (small, pickled) -------------------------------------------------------------------------------------

def send_obj(pg, obj, dst, device="cpu"):
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
    pg.send([torch.tensor([data.numel()], dtype=torch.int64, device=device)], dst, 0).wait()
    pg.send([data], dst, 1).wait()


def recv_obj(pg, src, device="cpu"):
    size = torch.zeros(1, dtype=torch.int64, device=device)
    pg.recv([size], src, 0).wait()
    data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    pg.recv([data], src, 1).wait()
    return pickle.loads(data.cpu().numpy().tobytes())


# ---- weights (flat buckets) ----------------------------------------------------------------------------------------

def plan_buckets(meta, bucket_mb, dtype):
    """meta: [(name, shape)] in send order -> list of buckets, each a list of (name, shape, offset, numel)."""
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


def send_header(pg, version, discarded, has_weights=False, stop=False, device="cpu"):
    h = torch.tensor([version, discarded, int(has_weights), int(stop)], dtype=torch.int64, device=device)
    pg.broadcast(h, 0).wait()


def send_weights(pg, full_tensors, buckets, dtype, device="cpu"):
    """Trainer side. full_tensors yields (name, tensor) in the planned order, one tensor at a time, so a sharded
    model is gathered bucket by bucket and never held twice in full. Every trainer rank must drive the iterator
    (gathering a sharded tensor is a collective); only rank 0 passes a group and sends."""
    it, sending = iter(full_tensors), None
    for bucket in buckets:
        flat = torch.empty(sum(n for *_, n in bucket), dtype=dtype, device=device) if pg is not None else None
        for name, shape, off, n in bucket:
            got, t = next(it)
            assert got == name, f"weight order changed: expected {name}, got {got}"
            if flat is not None:
                flat[off:off + n].copy_(t.reshape(-1))
        if pg is not None:  # this bucket goes out while the next one is gathered and packed
            if sending is not None:
                sending.wait()
            sending = pg.broadcast(flat, 0)
    if sending is not None:
        sending.wait()


def recv_header(pg, device="cpu"):
    h = torch.zeros(HEADER, dtype=torch.int64, device=device)
    pg.broadcast(h, 0).wait()
    version, discarded, has_weights, stop = h.tolist()
    return version, discarded, bool(has_weights), bool(stop)


def recv_weights(pg, buckets, dtype, device="cpu"):
    """Rollout side: receive every bucket into a fresh buffer; returns [(name, view)] ready for a reload."""
    out, works = [], []
    for bucket in buckets:  # every receive posted at once: the buckets arrive back to back
        flat = torch.empty(sum(n for *_, n in bucket), dtype=dtype, device=device)
        works.append(pg.broadcast(flat, 0))
        out += [(name, flat[off:off + n].view(shape)) for name, shape, off, n in bucket]
    for w in works:
        w.wait()
    return out
