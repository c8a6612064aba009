"""
train.py: asynchronous GRPO. `torchrun --nproc_per_node=N train.py config/X.py [--key=value ...]`
(`python train.py ...` is the same as N = 1).

N trainer ranks shard the policy with FSDP2 (one code path for 1 or many ranks, CPU/gloo or GPU/NCCL). Rank 0
starts the rollout side: `rollout_engines` vLLM engines that generate all the time (rollout.py). Per optimizer
step, the loop below:
  1. takes a batch of groups from the buffer (the only place it ever waits for generation),
  2. computes the GRPO loss (loss.py) in micro-batches and steps the optimizer,
  3. pushes the new weights to every vLLM worker (sync.py), which load them between two engine steps,
  4. logs a line, a JSON object to {out_dir}/metrics.jsonl and a few completions to samples.jsonl (metrics.py).
Version k = the weights after k optimizer steps; batch k is trained at version k. With ckpt_every,
{out_dir}/ckpt.pt holds the weights, AdamW, the version and the prompt stream position; --resume goes on from it
exactly. Ctrl-C or SIGTERM stops every rank at the next step boundary, after writing that checkpoint.

Simplifications: one optimizer step per batch; AdamW at a constant learning rate; micro-batches of whole groups
(completions padded within chunks of similar length, not packed; ranks agree on the number of chunks, which
FSDP's collectives need, not on their widths); rank 0 alone talks to the rollout side and deals each batch out to
the other ranks.
"""
import json
import os
import resource
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, AutoTokenizer

import buffer as buf
import configurator
import loss as L
import metrics
import rollout
import sync

# -----------------------------------------------------------------------------------------------------------------
# default config; config/*.py files and --key=value override these (and only these) keys (configurator.py)
model = "data/tiny"  # a Hugging Face model folder, or a hub id where the hub is reachable
task = "arithmetic"  # arithmetic | gsm8k (reward.py)
data_path = ""  # gsm8k: a jsonl file of {"question", "answer"}, or a hub dataset id (openai/gsm8k)
eval_path = ""  # gsm8k: held-out jsonl; empty = the hub dataset's test split, or eval_n held-out problems
out_dir = "out"
seed = 1337
max_steps = 20  # optimizer steps (= policy versions)
batch_groups = 8  # prompt groups per optimizer step (split over trainer ranks)
group_size = 8  # completions per prompt
max_new_tokens = 64
temperature = 1.0  # sampling temperature; the trainer's logprobs use the same one
lr = 1e-5
weight_decay = 0.0
grad_clip = 1.0
micro_batch_groups = 1  # prompt groups per forward/backward
activation_checkpointing = False  # recompute each layer's MLP in the backward pass: less memory, more compute
max_staleness = 1  # eta: a sample's oldest token may be at most this many versions old; 0 = synchronous
drop_flat = True  # discard groups whose rewards are all equal (zero advantage, no signal)
adv_norm_std = False  # divide advantages by the group's reward std
tis_cap = 3.0  # importance weights pi_theta / pi_behaviour above this are truncated to it (loss.py)
kl_coef = 0.0  # KL(pi || reference) penalty; 0 = no reference model at all
eval_every = 5  # greedy held-out eval every this many versions (and at the start and end); 0 = off
eval_n = 100  # held-out problems, never trained on
rollout_engines = 1  # vLLM engines, each on its own tensor_parallel_size GPUs after the trainer ranks'
tensor_parallel_size = 1  # GPUs per vLLM engine
colocate = False  # trainer and vLLM share the device: weights pass through shared memory, not a broadcast
rollout_groups = 32  # most prompt groups in flight in one engine at once
rollout_dtype = "float32"  # vLLM weights and compute
trainer_dtype = "float32"  # FSDP2 compute dtype (master weights and gradient reduction stay float32)
trainer_threads = 0  # CPU threads per trainer rank; 0 = leave torchrun's OMP_NUM_THREADS (1) alone
rollout_cpus = ""  # CPU only: cores for vLLM, e.g. "1" or "2-3"; the trainer ranks keep the others. "" = share all
borrow_cpus = True  # CPU, one rank: while vLLM waits at the staleness bound, the trainer computes on its cores too
max_model_len = 512
kv_cache_gb = 1  # vLLM KV cache on CPU (GiB)
gpu_memory_utilization = 0.5  # vLLM's share of its GPU (with colocate, the trainer has the rest)
enforce_eager = True  # no CUDA graphs / compilation in vLLM (start-up seconds instead of minutes)
bucket_mb = 64  # weight push bucket size
rollout_host = "127.0.0.1"  # where trainer rank 0 hosts the trainer<->rollout store
rollout_port = 29600
timeout_s = 120  # a peer silent this long is dead: the run exits instead of hanging
reward_timeout_s = 5.0
max_bad_steps = 3  # this many NaN/inf gradients in a row (each step skipped) stop the run
wandb_log = False  # also log to Weights & Biases (pip install wandb; WANDB_MODE=offline works without network)
wandb_project = "nanoasync"
wandb_run_name = ""
ckpt_every = 0  # write {out_dir}/ckpt.pt every this many steps, at the end, and on Ctrl-C/SIGTERM; 0 = never
resume = False  # continue from {out_dir}/ckpt.pt: weights, optimizer, version, prompt stream position
# -----------------------------------------------------------------------------------------------------------------
config = configurator.apply(globals(), sys.argv[1:])
for k, v in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "1"),
             ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")):
    os.environ.setdefault(k, v)  # plain `python train.py` = one rank
rank, world, local_world = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"))
master = rank == 0
config = configurator.check(config, world)
model = config["model"]  # a hub id is now a local folder in the hub cache

# ---- placement: trainer ranks on the first GPUs of each node, the engines after them on the first node ----
device = torch.device(f"cuda:{os.environ['LOCAL_RANK']}" if torch.cuda.is_available() else "cpu")
try:
    engine_gpus, borrow = rollout.place(config, world, local_world, device, master)
except ValueError as e:
    configurator.die(str(e))
dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(seconds=timeout_s),
                        device_id=device if device.type == "cuda" else None)
torch.manual_seed(seed)
if trainer_threads > 0:
    torch.set_num_threads(trainer_threads)
base_threads = torch.get_num_threads()

# ---- the policy: FSDP2 per decoder layer, then the root (embeddings, norm, head) ----
policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).to(device)
if activation_checkpointing:  # MLPs only: attention must not run twice, it appends to the prompt's shared KV cache
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    for layer in policy.model.layers:
        layer.mlp = checkpoint_wrapper(layer.mlp)
compute_dtype = getattr(torch, trainer_dtype)
mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
for layer in policy.model.layers:
    fully_shard(layer, mp_policy=mp)
fully_shard(policy, mp_policy=mp)
optimizer = torch.optim.AdamW(policy.parameters(), lr=lr, weight_decay=weight_decay)
reference = None
if kl_coef > 0:
    reference = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).to(device).eval()
    reference.requires_grad_(False)
full_state = StateDictOptions(full_state_dict=True, cpu_offload=True, broadcast_from_rank0=True)


def hf_name(name):  # the checkpoint wrapper inserts itself into parameter names
    return name.replace("_checkpoint_wrapped_module.", "")


def full_weights(dtype=compute_dtype):
    """(HF name, full tensor), by default in the trainer's compute dtype: each shard is cast before the gather
    (half the bytes of fp32 in bf16), and a tied embedding comes once (named_parameters skips the alias)."""
    for name, p in policy.named_parameters():
        p = p.detach().to(dtype)
        yield hf_name(name), p.full_tensor() if isinstance(p, DTensor) else p


meta = [(hf_name(name), tuple(p.shape)) for name, p in policy.named_parameters()]
buckets = sync.plan_buckets(meta, bucket_mb, getattr(torch, rollout_dtype))  # the same plan on every side


def save_checkpoint(version, state):
    """Every rank joins the gather; rank 0 writes {out_dir}/ckpt.pt atomically (a crash mid-write leaves the
    previous checkpoint intact). state: what rank 0 needs to continue exactly (prompt stream position, counters)."""
    model_sd, optim_sd = get_state_dict(policy, optimizer, options=full_state)
    if master:
        with open(ckpt_path + ".tmp", "wb") as f:
            torch.save({"version": version, "model": model_sd, "optim": optim_sd,
                        "torch_rng": torch.get_rng_state(), **state}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(ckpt_path + ".tmp", ckpt_path)


ckpt_path, ckpt = os.path.join(out_dir, "ckpt.pt"), {}
if resume:  # rank 0 reads the file; the weights and optimizer state reach the other ranks' shards by broadcast
    ckpt = torch.load(ckpt_path, weights_only=True) if master else {"model": {}, "optim": {}}
    set_state_dict(policy, optimizer, model_state_dict=ckpt.pop("model"), optim_state_dict=ckpt.pop("optim"),
                   options=full_state)
    if master:
        torch.set_rng_state(ckpt["torch_rng"])
box = [ckpt.get("version", 0)]
dist.broadcast_object_list(box, src=0)
start = box[0]  # version k = the weights after k optimizer steps: this run's first batch is trained at version start


def pad(rows, width):
    return torch.tensor([r + [0] * (width - len(r)) for r in rows], device=device, dtype=torch.float32)


stop_signal = []  # Ctrl-C / SIGTERM: the loop stops at the next step boundary
for sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(sig, lambda signum, frame: stop_signal.append(signum))

# ---- rank 0: start the rollout side; from here on it generates all the time ----
if master:
    os.makedirs(out_dir, exist_ok=True)
    json.dump(config, open(os.path.join(out_dir, "train_config.json"), "w"), indent=1)  # config.json: the model's
    try:
        fleet = buf.Rollouts(config, buckets, device, engine_gpus, ckpt, lambda: bool(stop_signal))
    except (RuntimeError, TimeoutError) as e:  # port taken, or a rollout process died while starting
        configurator.die(str(e))
samples, gen_tokens = ckpt.get("samples", 0), ckpt.get("gen_tokens", 0)
skipped_steps = bad_in_a_row = 0
version = step = start
t_start = time.perf_counter() - ckpt.get("elapsed_s", 0.0)
log = metrics.Log(config, start, t_start) if master else None


def resume_state():
    return {**fleet.resume_state(), "samples": samples, "gen_tokens": gen_tokens,
            "elapsed_s": time.perf_counter() - t_start} if master else None


def push_weights(version):
    if master:
        sync.send_header(fleet.ctl, version, has_weights=True)
    return sync.push(fleet.sender, full_weights(), buckets, fleet.check_alive) if master else \
        sync.push(None, full_weights(), buckets)


try:
    if start > 0:  # resumed: the engines generate from the checkpointed weights
        push_weights(start)
    for step in range(start, max_steps):
        version = step
        # ---- 1. a batch: generated while we trained the previous one ----
        t0 = time.perf_counter()
        batch = t_wait = None  # rank 0 sends None to every rank to stop the run at this step boundary
        if master and not stop_signal:
            try:
                # the overlap, 1 of 2: a batch the engines generated while the previous step trained
                groups, seen, t_wait = fleet.buffer.get(version, batch_groups, fleet.check_alive)
                n_tok = sum(len(c["ids"]) for g in groups for c in g["completions"])  # flat groups' tokens too
                batch = buf.split(buf.worth_a_forward(groups, world, kl_coef > 0), world), n_tok
            except buf.Stopped:
                pass
        box = [batch]
        dist.broadcast_object_list(box, src=0)
        if box[0] is None:  # Ctrl-C or SIGTERM: stop between two steps, where the state is whole
            if ckpt_every:
                save_checkpoint(version, resume_state())
            raise buf.Stopped()
        shards, n_tok = box[0]
        mine, n_tok = shards[rank], torch.tensor([float(n_tok)], device=device)
        t_wait = t_wait if master else time.perf_counter() - t0
        # ---- 2. loss and one optimizer step ----
        t0 = time.perf_counter()
        sums, borrowed = torch.zeros(len(metrics.SUMS), device=device), 0
        # every micro-batch's backward reduce-scatters its gradients into the fp32 shards: no rank ever holds a
        # full unsharded gradient across micro-batches (FSDP's no-sync accumulation would), for one more collective
        for i in range(0, len(mine), micro_batch_groups):
            mb = mine[i:i + micro_batch_groups]
            if borrow:  # every engine is idle until the next weights: compute on its cores meanwhile
                lent = fleet.idle(version)
                borrowed += lent
                torch.set_num_threads(base_threads + borrow * lent)
            n_chunks = 0  # completions run in chunks of similar length (loss.plan_chunks)
            if world > 1:  # FSDP's collectives need the same number of forward calls on every rank, not shapes
                n_chunks = torch.tensor([len(L.plan_chunks([len(c["ids"]) for g in mb for c in g["completions"]]))],
                                        device=device)
                dist.all_reduce(n_chunks, op=dist.ReduceOp.MAX)
                n_chunks = int(n_chunks)
            logp, mask, positions = L.token_logprobs(policy, mb, temperature, device, n_chunks=n_chunks)
            comps = [c for g in mb for c in g["completions"]]
            behav = pad([c["logprobs"] for c in comps], logp.shape[1])
            adv = torch.cat([L.group_advantages(torch.tensor([c["reward"] for c in g["completions"]], device=device),
                                                len(g["completions"]), adv_norm_std) for g in mb])
            ref_logp = None
            if reference is not None:
                with torch.no_grad():
                    ref_logp, _, _ = L.token_logprobs(reference, mb, temperature, device, n_chunks=n_chunks)
            loss, trunc = L.grpo_loss(logp, behav, adv, mask, n_tok, tis_cap, ref_logp, kl_coef)
            (loss * world).backward()  # FSDP averages gradients over ranks; the loss is already a global token mean
            versions = pad([c["versions"] for c in comps], logp.shape[1])
            sums += metrics.token_sums(loss, trunc, logp, behav, mask, versions == step, positions)
        grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), grad_clip)
        grad_norm = grad_norm.full_tensor() if isinstance(grad_norm, DTensor) else grad_norm
        if torch.isfinite(grad_norm):  # the same on every rank: the norm is global
            optimizer.step()
            bad_in_a_row = 0
        else:  # a NaN/inf gradient would poison the weights (and vLLM's copy): skip the step, stop if it persists
            skipped_steps, bad_in_a_row = skipped_steps + 1, bad_in_a_row + 1
            print(f"warning: step {step}: gradient norm {grad_norm.item()}, optimizer step skipped", file=sys.stderr)
            if bad_in_a_row >= max_bad_steps:
                raise FloatingPointError(f"{bad_in_a_row} optimizer steps in a row had a NaN/inf gradient; lower "
                                         f"lr or check the data (max_bad_steps={max_bad_steps})")
        optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(sums)
        t_train = time.perf_counter() - t0
        version = step + 1
        # ---- 3. new weights to every engine, which loads them without stopping generation ----
        t0 = time.perf_counter()
        sync_bytes = push_weights(version)  # the overlap, 2 of 2: the engines load it between two steps
        t_sync = time.perf_counter() - t0
        # ---- 4. log ----
        if master:
            s = dict(zip(metrics.SUMS, sums.tolist()))
            samples += sum(len(g["completions"]) for g in groups)
            gen_tokens += sum(len(c["ids"]) for g in seen for c in g["completions"])
            m = metrics.step_row(
                step, groups, seen, s, rollout_engines, dropped_stale=fleet.buffer.dropped_stale,
                dropped_flat=fleet.buffer.dropped_flat, grad_norm=grad_norm.item(), skipped_steps=skipped_steps,
                train_tokens_per_s=(s["fresh"] + s["stale"]) / t_train, samples=samples, gen_tokens=gen_tokens,
                t_wait_s=t_wait, t_train_s=t_train, t_sync_s=t_sync, sync_bytes=sync_bytes,
                elapsed_s=time.perf_counter() - t_start,
                borrowed_frac=borrowed / max(len(range(0, len(mine), micro_batch_groups)), 1),
                trainer_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, **fleet.rollout_stats())
            fleet.consume(seen)
            log.step(m, groups, fleet.evals)
        if ckpt_every and version % ckpt_every == 0:
            save_checkpoint(version, resume_state())
    # ---- the end: the final eval, the model in Hugging Face format ----
    if ckpt_every and version % ckpt_every:
        save_checkpoint(version, resume_state())
    full = {name: t.cpu() for name, t in full_weights(torch.float32)}
    if master:
        AutoTokenizer.from_pretrained(model).save_pretrained(out_dir)
        policy.save_pretrained(out_dir, state_dict=full)
        if eval_every > 0:
            fleet.wait_for_eval(max_steps, timeout_s)
        log.evals(fleet.evals)
        log.close()
        fleet.stop(max_steps, timeout_s)
        try:
            print("curves:", metrics.plot(out_dir))
        except ImportError:  # matplotlib is optional
            pass
except buf.Stopped:
    if master:
        saved = f"; checkpoint at version {version} in {ckpt_path}, continue with --resume" if ckpt_every else ""
        print(f"stopped by {signal.Signals(stop_signal[0]).name} at step {step}{saved}", file=sys.stderr, flush=True)
    sys.exit(128 + stop_signal[0])
except Exception as e:
    if not master or not fleet.explain(e, step):  # a broken connection usually means a rollout process died
        raise
    sys.exit(1)
finally:
    if master:
        fleet.kill()
dist.destroy_process_group()
