"""train.py: asynchronous GRPO. `torchrun --nproc_per_node=N train.py config/X.py [--key=value]`.
FSDP2 ranks train; vLLM engines generate nonstop (fleet.py). Step k takes a batch (buffer.py),
trains version k (loss.py), sends weights (sync.py), logs. Simplifications: one AdamW step a
batch, constant lr; no KL penalty or reference model (as DAPO); rank 0 alone talks to engines.

Runs in every trainer rank that torchrun starts: the same file, top to bottom, on each, with
`master` (rank 0) also owning the engines' end of every wire, the buffer, the log and the
checkpoints. Rank 0 is the only rank that reads or writes files in out_dir."""
import json, os, signal, sys, time, traceback
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from transformers import AutoModelForCausalLM, AutoTokenizer

import buffer, configurator
import loss as L
import lora, metrics, sync
from fleet import Fleet, kill, place, report_exits, spawn, store_host, watch

# ---- config/*.py, then --key=value, override these defaults ----
model = "data/tiny"  # an HF folder or hub id
task = "arithmetic"  # arithmetic | gsm8k | calculator | rg:NAME | env:MODULE:CLASS (env.py)
data_path = ""  # gsm8k: jsonl of {"question", "answer"}, or a hub id
out_dir = "out"
tracker = ""  # wandb | trackio
seed = 1337
max_steps = 20  # optimizer steps = policy versions
batch_groups = 8  # prompt groups a step (all ranks)
group_size = 8  # completions a prompt
max_new_tokens = 64  # per completion, tool results too
max_turns = 4  # model turns a completion (1: no tool)
temperature = 1.0  # sampling, and the trainer's logprobs
lr = 1e-5
grad_clip = 1.0
micro_batch_tokens = 4096  # packed tokens a micro-batch (a larger group alone)
activation_checkpointing = False  # recompute layers in backward
compile_layers = True  # GPU, bf16/fp16: torch.compile each layer in step 0
max_staleness = 1  # eta: most versions a trained token may lag; 0 = synchronous
drop_flat = True  # skip groups with all rewards equal
eval_every = 5  # versions between greedy held-out evals (also first, last); 0 = off
eval_n = 100  # held-out problems, never trained on
rollout_engines = 1  # vLLM engines a node, each on tensor_parallel_size GPUs
tensor_parallel_size = 1
colocate = False  # trainer and vLLM share one GPU, weights by shared memory
stage_weights = True  # receive weights into a copy as vLLM generates; False: paused
rollout_seqs = 256  # most sequences an engine generates at once
rollout_dtype = "float32"  # vLLM's weights and compute (output layer: float32)
trainer_dtype = "float32"  # FSDP2 compute (master weights: float32)
loss_scale = 65536.0  # fp16: small gradients would flush to 0; halved on overflow
rollout_cpus = ""  # CPU: vLLM's cores, "1" or "2-3"; the trainer's: the rest
borrow_cpus = True  # CPU, one rank: vLLM's cores too while every engine waits
max_model_len = 512
kv_cache_gb = 1  # vLLM's KV cache on CPU (GiB)
gpu_memory_utilization = 0.5  # vLLM's share of its GPU (colocate: the trainer has the rest)
enforce_eager = True  # no CUDA graphs: vLLM starts in seconds
rollout_port = 29600  # the trainer-engine store, on rank 0
timeout_s = 120  # a peer silent this long is dead: exit
start_timeout_s = 900  # engine start (GPU: compiling, CUDA graphs)
stall_s = 600  # this long with nothing usable (flat, stale): stop
unsafe_graders = False  # run graders that evaluate the model's text as code (reward.UNSAFE_RG)
reward_timeout_s = 5.0  # a longer grade is killed, scores 0 (reward_failed)
grader_workers = 2  # grader processes per engine
# {out_dir}/ckpt.pt every K steps and at the end; and at any stop between two steps (a signal, a
# stall, a dead engine, a non-finite gradient), so a crash loses at most K steps. 0: never
ckpt_every = 50
resume = False  # continue exactly from {out_dir}/ckpt.pt
lora_rank = 0  # > 0: train a LoRA adapter of this rank (lora.py), base frozen
lora_alpha = 32  # the adapter's scale: lora_alpha / lora_rank
lora_targets = "all-linear"  # PEFT's target_modules, or "q_proj,v_proj"
# as the user wrote it (a hub id, not its cache folder): for checkpoints
given = configurator.apply(globals(), sys.argv[1:])
for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                 GROUP_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500").items():
    os.environ.setdefault(k, v)  # `python train.py`: one rank
rank = int(os.environ["RANK"])
world = int(os.environ["WORLD_SIZE"])
local_rank = int(os.environ["LOCAL_RANK"])
local_world = int(os.environ["LOCAL_WORLD_SIZE"])
nodes = int(os.environ["GROUP_WORLD_SIZE"])
master = rank == 0
config = configurator.check(given, world)
model = config["model"]  # a hub id is now a folder

# ---- placement: a node's ranks take its first GPUs, its engines the next ----
cuda = torch.cuda.is_available()
if not cuda and torch.version.cuda:
    configurator.die(f"torch {torch.__version__} sees no GPU: CUDA 13 needs NVIDIA driver >= 580 "
                     "(nvidia-smi); or CUDA_VISIBLE_DEVICES is empty; no GPU: requirements-cpu.txt")
device = torch.device(f"cuda:{local_rank}" if cuda else "cpu")
engine_gpus, borrow = place(config, world, local_world, device, local_rank == 0)
dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None,
                        timeout=timedelta(seconds=timeout_s))
threads = torch.get_num_threads()  # CPU: our cores
batches = dist.new_group(backend="gloo", timeout=timedelta(days=7))  # as rank 0 waits, stall_s

# ---- the policy, sharded, and its optimizer ----
# a LoRA base is frozen: loaded in the compute dtype (no fp32 copy ever); trained weights in fp32
dtype = getattr(torch, trainer_dtype)
policy = AutoModelForCausalLM.from_pretrained(
    model, dtype=dtype if lora_rank else torch.float32).to(device)
if lora_rank:
    try:
        policy = lora.add(policy, config, dtype)
    except ValueError as e:  # lora_targets the model has not: one line, as every config error
        configurator.die(str(e))
L.shard(policy, dtype, activation_checkpointing, compile_layers)
trained = [(name, p) for name, p in policy.named_parameters() if p.requires_grad]  # or LoRA's
optimizer = torch.optim.AdamW([p for _, p in trained], lr=lr, weight_decay=0.0, fused=cuda)
full_state = StateDictOptions(full_state_dict=True, cpu_offload=True, broadcast_from_rank0=True,
                              ignore_frozen_params=lora_rank > 0, strict=lora_rank == 0)


def full_weights(dtype=dtype):
    """(name, full tensor), cast before the gather (bf16: half the bytes). All ranks run it."""
    for name, p in trained:  # each a DTensor (FSDP2)
        yield name, p.detach().to(dtype).full_tensor()


# each weight's place in the flat copies (sync.py)
plan = sync.plan([(name, p.shape) for name, p in trained], getattr(torch, rollout_dtype))
push_bytes = sum(n for _, n, _ in plan) * getattr(torch, rollout_dtype).itemsize
ckpt_path = f"{out_dir}/ckpt.pt"


def save_checkpoint(version):  # all gather; rank 0 writes it atomically
    global saved
    model_sd, optim_sd = get_state_dict(policy, optimizer, options=full_state)
    if master:
        with open(ckpt_path + ".tmp", "wb") as f:
            torch.save({"version": version, "model": model_sd, "optim": optim_sd,
                        "loss_scale": loss_scale, "config": given, **fleet.resume_state(),
                        **log.state()}, f)
            os.fsync(f.fileno())
        os.replace(ckpt_path + ".tmp", ckpt_path)
    saved = f"checkpoint at version {version}, continue with --resume"


saved = ""  # what the last checkpoint written by this run holds, for the last words


ckpt = torch.load(ckpt_path, weights_only=True) if resume and master else {}
if resume:  # rank 0 read it; others get shards by broadcast
    set_state_dict(policy, optimizer, model_state_dict=ckpt.pop("model", {}),
                   optim_state_dict=ckpt.pop("optim", {}), options=full_state)
resumed = [ckpt.get("version", 0), ckpt.get("loss_scale", 1.0)]
dist.broadcast_object_list(resumed, src=0)
start, reached = resumed
loss_scale = reached if reached > 1 else loss_scale  # an fp16 run: the scale it had
if trainer_dtype != "float16":  # bf16 has fp32's range
    loss_scale = 1.0
stop_signal = []  # Ctrl-C / SIGTERM: stop between steps
for sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(sig, lambda signum, _: stop_signal.append(signum))

# ---- each node's first rank starts its engines; all watch each other ----
engines = []  # this rank's, if it leads another node
if master:
    os.makedirs(out_dir, exist_ok=True)
    json.dump(config, open(f"{out_dir}/train_config.json", "w"), indent=1)
    fleet = Fleet(
        config, plan, device, engine_gpus, ckpt, lambda: stop_signal, nodes, world, local_world)
    log = metrics.Log(config, start, ckpt)
    heartbeat = fleet.heartbeat
else:
    if engine_gpus:  # another node's, numbered after node 0's
        engines = spawn(config, engine_gpus, rank // local_world * rollout_engines,
                        rollout_engines * nodes, store_host(nodes), plan)
    heartbeat = watch(config, rank, world, local_world, nodes, engines)


def push_weights(version):  # all gather; rank 0 hands them to the engines (sync.py)
    if master:
        fleet.sender.push(full_weights(), version, lambda: fleet.check_alive(False))
    else:
        for _ in full_weights():  # each full_tensor() is an all-gather
            pass


def micro_batch(groups, step, n_tok):  # loss, backward -> its share of metrics.SUMS
    batch = L.to_device(L.pack(groups), device)
    logp = L.token_logprobs(policy, batch, temperature)  # [C, T]
    adv = L.group_advantages(batch["rewards"], group_size)
    loss, bounded = L.grpo_loss(logp, batch["behav"], adv, batch["mask"], n_tok)
    (loss * world * loss_scale).backward()  # FSDP averages over ranks
    fresh = batch["versions"] == step  # sampled by the weights we train
    return metrics.token_sums(loss, bounded, logp, batch["behav"], batch["mask"], fresh)


step = start
died = None  # rank 0: the error that named a dead engine
try:
    if start > 0:  # resumed: checkpoint weights first
        push_weights(start)
    for step in range(start, max_steps):  # step k trains version k into k + 1
        # ---- 1. a batch: rank 0 takes it, deals it out ----
        msg = {}  # {"shares": groups a rank, "n_tok"} or {"stop": why}
        if master:
            try:  # the overlap, 1 of 2: generated as we trained the last
                groups, seen, t_wait = fleet.buffer.get(
                    step, batch_groups, fleet.check_alive, log.waiting)
                n_tok = sum(int(c["mask"].sum()) for g in groups for c in g["completions"])
                msg = {"shares": buffer.deal(groups, world), "n_tok": n_tok}
            except buffer.Stopped as e:
                msg = {"stop": str(e)}
            except RuntimeError as e:  # an engine died; our state is whole all the same
                msg, died = {"stop": str(e), "failed": True}, e
        box = [msg]
        dist.broadcast_object_list(box, src=0, group=batches)
        msg = box[0]
        if "stop" in msg:  # between steps, where the state is whole: keep it
            # the engines are going: no rank may take their silence for a reason to exit
            # while a large checkpoint is written
            heartbeat.forget()
            if ckpt_every and step > start:  # (nothing new: a re-run needs no --resume)
                save_checkpoint(step)
            if msg.get("failed"):
                raise died if master else RuntimeError(msg["stop"])
            raise buffer.Stopped(msg["stop"])
        mine = L.micro_batches(msg["shares"][rank], micro_batch_tokens)
        # ---- 2. the loss and one optimizer step ----
        t0 = time.perf_counter()
        sums = torch.zeros(len(metrics.SUMS), device=device)
        borrowed = 0  # micro-batches on the engines' cores too
        for i, groups_i in enumerate(mine):
            # one reduce-scatter, after the last backward; weights kept gathered
            last = i == len(mine) - 1
            policy.set_requires_gradient_sync(last)
            policy.set_reshard_after_backward(last)
            if borrow:  # every engine awaits the weights we train: its cores
                idle = fleet.idle(step)
                torch.set_num_threads(threads + (borrow if idle else 0))
                borrowed += idle
            sums += micro_batch(groups_i, step, msg["n_tok"])
        for _, p in trained if loss_scale != 1 else ():  # fp16: unscaled
            p.grad.div_(loss_scale)
        grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), grad_clip).full_tensor()
        dist.all_reduce(sums)
        forward_ok = torch.isfinite(sums[0])  # the loss: a forward that overflowed has none
        if torch.isfinite(grad_norm) and forward_ok:
            optimizer.step()
        elif loss_scale > 1 and forward_ok:  # fp16's scaled backward overflowed: skip, halve
            loss_scale /= 2
        else:  # it would poison the weights: stop, keeping the last good ones
            if ckpt_every and step > start:
                save_checkpoint(step)
            why = "lower lr or check the data"  # a smaller scale would not help a forward
            if trainer_dtype == "float16" and not forward_ok:
                why = "the forward pass overflowed float16's range: use bfloat16"
            raise FloatingPointError(f"step {step}: gradient norm {grad_norm.item()}: {why} (then "
                                     "--resume from the last checkpoint)")
        optimizer.zero_grad()
        t_train = time.perf_counter() - t0
        version = step + 1
        # ---- 3. the new weights to every engine ----
        t0 = time.perf_counter()
        push_weights(version)  # the overlap, 2 of 2: sent, received beside generation
        t_sync = time.perf_counter() - t0
        # ---- 4. log ----
        if master:
            log.step(step, groups, seen, sums.tolist(), fleet, grad_norm=grad_norm.item(),
                     t_wait_s=t_wait, t_train_s=t_train, t_sync_s=t_sync, push_bytes=push_bytes,
                     borrowed_frac=borrowed / len(mine), micro_batches=len(mine),
                     loss_scale=loss_scale)
            fleet.done.update(g["pos"] for g in seen)  # for a checkpoint
        if ckpt_every and (version % ckpt_every == 0 or version == max_steps):
            save_checkpoint(version)
    # ---- the end: the model (HF format), the last eval ----
    full = {name: t.cpu() for name, t in full_weights(torch.float32)}  # all ranks gather
    if master:
        AutoTokenizer.from_pretrained(model).save_pretrained(out_dir)
        if lora_rank:  # the adapter (PEFT's format)
            lora.save(full, config, out_dir)
        else:
            policy.save_pretrained(out_dir, state_dict=full)
        if eval_every > 0:
            fleet.wait(lambda: any(e["version"] == max_steps for e in fleet.evals), timeout_s)
        log.close(fleet.evals)
        fleet.stop(timeout_s)  # all engines on all nodes exit
    kill(engines, timeout_s)  # another node's: they exit as rank 0 says stop
    # heartbeats stop between barriers: one beating would take rank 0's exit for a crash
    dist.barrier(group=batches)
    heartbeat.stop()
    dist.barrier()
except Exception as error:  # a signal, a stall (Stopped), an error: all ranks end here
    if not isinstance(error, buffer.Stopped):
        if saved and master:
            print(f"{saved} once the cause below is fixed", file=sys.stderr)
        if master and isinstance(error, RuntimeError):  # a broken wire: whose?
            if error is died:  # an engine, named: a rank's silence now is no news
                heartbeat.forget(ranks=True)
            try:  # time for an exit code to show (check_alive), or a silence (heartbeats)
                fleet.wait(lambda: False, 3 if error is died else sync.DEAD_S + 2)
            except Exception as cause:
                error = cause
        traceback.print_exception(error)
    elif master:
        print(f"stopped at step {step}: {error}" + (f"; {saved}" if saved else ""), file=sys.stderr)
        log.close(fleet.evals)  # a tracker's run ends finished
    # another node's engines that died are named there, once
    report_exits(engines, rank // local_world, rollout_engines)
    kill(fleet.procs if master else engines)
    sys.stdout.flush()  # stderr: line-buffered
    # not sys.exit: tearing down groups whose threads wait on a peer hangs
    os._exit(128 + stop_signal[0] if isinstance(error, buffer.Stopped) and stop_signal else 1)
if master:
    fleet.close()
dist.destroy_process_group()
