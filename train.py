"""
train.py: asynchronous GRPO. `torchrun --nproc_per_node=N train.py config/X.py [--key=value ...]`
(`python train.py ...` is the same as N = 1).

N trainer ranks shard the policy with FSDP2 (one code path for 1 or many ranks, CPU/gloo or GPU/NCCL). Rank 0 starts
one extra process, rollout.py, which owns vLLM and generates all the time. Per optimizer step, the loop below:
  1. takes a batch of groups from the buffer (the only place it ever waits for generation),
  2. computes the GRPO loss with truncated importance weights (loss.py) in micro-batches and steps the optimizer,
  3. pushes the new weights to the rollout process (sync.py), which loads them between two engine steps,
  4. logs one line and one JSON object to {out_dir}/metrics.jsonl.
Version k = the weights after k optimizer steps; batch k is trained at version k. With ckpt_every, {out_dir}/ckpt.pt
holds the weights, AdamW, the version and the prompt stream position; --resume goes on from it exactly. Ctrl-C or
SIGTERM stops every rank at the next step boundary, after writing that checkpoint.

Simplifications: one optimizer step per batch; AdamW at a constant learning rate; micro-batches of whole groups
(completions padded within chunks of similar length, not packed; with several ranks one chunk, as wide as the
longest completion on any rank, so that every rank runs the same FSDP collectives); rank 0 alone talks to the rollout
process and deals each batch out to the other ranks.
Run `python train.py --plot OUT_DIR` to (re)draw OUT_DIR/curves.png; every run draws it at the end.
"""
import ast
import difflib
import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time

# -----------------------------------------------------------------------------------------------------------------
# default config; config/*.py files and --key=value override these (and only these) keys
model = "data/tiny"  # a Hugging Face model folder (see prepare.py for the offline ones)
task = "arithmetic"  # arithmetic | gsm8k (reward.py)
data_path = ""  # gsm8k: a jsonl file of {"question", "answer"}, or a hub dataset id where online
eval_path = ""  # gsm8k: held-out jsonl; empty = hold out eval_n training problems
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
rollout_groups = 32  # most prompt groups in flight in vLLM at once
tensor_parallel_size = 1  # GPUs for vLLM: the ones after the trainer ranks' on the first node
rollout_dtype = "float32"  # vLLM weights and compute
trainer_dtype = "float32"  # FSDP2 compute dtype (master weights and gradient reduction stay float32)
trainer_threads = 0  # CPU threads per trainer rank; 0 = leave torchrun's OMP_NUM_THREADS (1) alone
rollout_cpus = ""  # CPU only: cores for vLLM, e.g. "1" or "2-3"; the trainer ranks keep the others. "" = share all
borrow_cpus = True  # CPU, one rank: while vLLM waits at the staleness bound, the trainer computes on its cores too
max_model_len = 512
kv_cache_gb = 1  # vLLM KV cache on CPU (GiB)
gpu_memory_utilization = 0.5  # vLLM share of its GPU
enforce_eager = True  # no CUDA graphs / compilation in vLLM (start-up seconds instead of minutes)
bucket_mb = 64  # weight broadcast bucket size
rollout_host = "127.0.0.1"  # where trainer rank 0 hosts the trainer<->rollout store
rollout_port = 29600
timeout_s = 120  # a peer silent this long is dead: the run exits instead of hanging
reward_timeout_s = 5.0
max_bad_steps = 3  # this many NaN/inf gradients in a row (each step skipped) stop the run
ckpt_every = 0  # write {out_dir}/ckpt.pt every this many steps, at the end, and on Ctrl-C/SIGTERM; 0 = never
resume = False  # continue from {out_dir}/ckpt.pt: weights, optimizer, version, prompt stream position
# -----------------------------------------------------------------------------------------------------------------
config_keys = [k for k, v in globals().items() if not k.startswith("_") and isinstance(v, (int, float, bool, str))]


def die(msg):
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)


def check(key, value, origin):
    if key not in config_keys:
        near = difflib.get_close_matches(key, config_keys, n=1)
        die(f"unknown config key {key!r} in {origin}" + (f"; did you mean {near[0]!r}?" if near else ""))
    want = type(globals()[key])
    if want is float and type(value) is int:
        value = float(value)
    if type(value) is not want:
        die(f"config key {key!r} in {origin} must be {want.__name__}, got {type(value).__name__} {value!r}")
    return value


def parse_config(argv):
    cfg = {}
    for arg in argv:
        if arg.startswith("--"):
            key, eq, text = arg[2:].partition("=")
            if not eq and isinstance(globals().get(key), bool):
                text = "True"  # a bare --flag switches a boolean key on
            elif not eq:
                die(f"{arg!r} has no value: write --{key}=VALUE")
            try:
                value = ast.literal_eval(text)
            except (ValueError, SyntaxError):
                value = text  # a bare string, e.g. --model=data/tiny
            if isinstance(globals().get(key), str) and not isinstance(value, str):
                value = text  # a string key takes the text as written: --rollout_cpus=1
            cfg[key] = check(key, value, arg)
        else:
            if not os.path.isfile(arg):
                die(f"config file {arg!r} not found (configs live in config/, e.g. config/tiny.py)")
            scope = {}
            exec(open(arg).read(), scope)
            for key, value in scope.items():
                if not key.startswith("__"):
                    cfg[key] = check(key, value, arg)
    return cfg


def plot(run_dir):
    """{run_dir}/curves.png from metrics.jsonl: reward and eval accuracy against samples and against time, and where
    the trainer's time went."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    steps, evals = [r for r in rows if "loss" in r], [r for r in rows if "eval_accuracy" in r]
    per_version = {r["version"]: r for r in steps}
    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    for i, (x, label) in enumerate((("samples", "trained samples"), ("elapsed_s", "wall-clock (s)"))):
        ax[i].plot([r[x] for r in steps], [r["reward_mean"] for r in steps], label="train reward")
        ex = [per_version[e["version"]][x] if e["version"] in per_version else 0 for e in evals] if x == "samples" \
            else [e["elapsed_s"] for e in evals]
        ax[i].plot(ex, [e["eval_accuracy"] for e in evals], "o-", label="held-out accuracy (greedy)")
        ax[i].set_xlabel(label)
        ax[i].set_ylim(0, 1)
        ax[i].legend()
    bottom = [0.0] * len(steps)
    for key in ("t_wait_s", "t_train_s", "t_sync_s"):
        ax[2].bar([r["step"] for r in steps], [r[key] for r in steps], bottom=bottom, label=key[2:-2])
        bottom = [b + r[key] for b, r in zip(bottom, steps)]
    ax[2].set_xlabel("step")
    ax[2].set_ylabel("trainer seconds")
    ax[2].legend()
    fig.suptitle(run_dir)
    fig.tight_layout()
    fig.savefig(os.path.join(run_dir, "curves.png"), dpi=80)
    return os.path.join(run_dir, "curves.png")


if sys.argv[1:2] == ["--plot"]:
    sys.exit(print(plot(sys.argv[2])))
globals().update(parse_config(sys.argv[1:]))
config = {k: globals()[k] for k in config_keys}
# -----------------------------------------------------------------------------------------------------------------
import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

import buffer as buf
import loss as L
import reward
import sync

for k, v in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")):
    os.environ.setdefault(k, v)  # plain `python train.py` = one rank
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
device = f"cuda:{os.environ['LOCAL_RANK']}" if torch.cuda.is_available() else "cpu"
if batch_groups % world:
    die(f"batch_groups={batch_groups} is not divisible by the {world} trainer ranks: use a multiple of {world}")
if max_staleness < 0:
    die(f"max_staleness={max_staleness} must be >= 0 (0 = synchronous)")
if not os.path.isfile(os.path.join(model, "config.json")):
    die(f"model {model!r} is not a Hugging Face model folder (no config.json); `python prepare.py tiny|smollm2` makes one")
model_config = json.load(open(os.path.join(model, "config.json")))
archs = model_config.get("architectures") or []
if model_config.get("model_type") not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or \
        archs and not any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs):
    die(f"model {model!r} is a {'/'.join(archs) or model_config.get('model_type')!r} model, not a causal language "
        "model: use a decoder-only LM folder (one that AutoModelForCausalLM loads)")
try:  # the rollout process loads the task too; a bad dataset is cheaper to report here, before anything starts
    reward.load_task(config)
except (OSError, ValueError, KeyError) as e:
    die(str(e))
# the first node hosts vLLM: the rollout process takes the tensor_parallel_size GPUs after that node's trainer ranks'
if device != "cpu" and os.environ.get("GROUP_RANK", "0") == "0":
    gpus = os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(torch.cuda.device_count())))).split(",")
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    rollout_gpus = gpus[local_world:local_world + tensor_parallel_size]
    if len(rollout_gpus) < tensor_parallel_size:
        die(f"{local_world} trainer ranks + tensor_parallel_size={tensor_parallel_size} for vLLM need "
            f"{local_world + tensor_parallel_size} GPUs, this node has {len(gpus)}: use "
            f"--nproc_per_node={len(gpus) - tensor_parallel_size} or a smaller --tensor_parallel_size")
ckpt_path = os.path.join(out_dir, "ckpt.pt")
if resume and not os.path.isfile(ckpt_path):
    die(f"--resume: no checkpoint at {ckpt_path}; run without --resume (and with --ckpt_every=K to write one)")
if device != "cpu":
    torch.cuda.set_device(device)
dist.init_process_group("nccl" if device != "cpu" else "gloo", device_id=torch.device(device) if device != "cpu" else None)
torch.manual_seed(seed)
if trainer_threads > 0:
    torch.set_num_threads(trainer_threads)
base_threads, borrow = torch.get_num_threads(), 0
rollout_affinity = os.sched_getaffinity(0)
if device == "cpu" and rollout_cpus:  # disjoint cores, as two GPUs would be: no thread oversubscription
    lo, _, hi = rollout_cpus.partition("-")
    rollout_affinity = set(range(int(lo), int(hi or lo) + 1))
    # vLLM sits idle once it has generated all that staleness allows, until the next weights (a synchronous run's
    # whole training phase); a lone trainer rank then runs more threads, on vLLM's cores too (borrowed_frac)
    borrow = len(rollout_affinity) if borrow_cpus and world == 1 else 0
    if not borrow:
        os.sched_setaffinity(0, os.sched_getaffinity(0) - rollout_affinity)
master = rank == 0

# the policy: FSDP2 per decoder layer, then the root (embeddings, norm, head)
policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).to(device)
if activation_checkpointing:  # MLPs only: attention must not run twice, it appends to the prompt's shared KV cache
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    for layer in policy.model.layers:
        layer.mlp = checkpoint_wrapper(layer.mlp)
mp = MixedPrecisionPolicy(param_dtype=getattr(torch, trainer_dtype), reduce_dtype=torch.float32)
for layer in policy.model.layers:
    fully_shard(layer, mp_policy=mp)
fully_shard(policy, mp_policy=mp)
optimizer = torch.optim.AdamW(policy.parameters(), lr=lr, weight_decay=weight_decay)
reference = None
if kl_coef > 0:
    reference = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).to(device).eval()
    reference.requires_grad_(False)
# HF names and full shapes, in a fixed order; includes lm_head.weight even when tied (vLLM wants it)
meta = [(name, tuple(p.shape)) for name, p in policy.state_dict().items()]
buckets = sync.plan_buckets(meta, bucket_mb, getattr(torch, rollout_dtype))
full_state = StateDictOptions(full_state_dict=True, cpu_offload=True, broadcast_from_rank0=True)


def save_checkpoint(version, state):
    """Every rank joins the gather; rank 0 writes {out_dir}/ckpt.pt atomically (a crash mid-write leaves the previous
    checkpoint intact). state: what rank 0 needs to continue exactly (prompt stream position, counters)."""
    model_sd, optim_sd = get_state_dict(policy, optimizer, options=full_state)
    if master:
        with open(ckpt_path + ".tmp", "wb") as f:
            torch.save({"version": version, "model": model_sd, "optim": optim_sd, "torch_rng": torch.get_rng_state(),
                        **state}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(ckpt_path + ".tmp", ckpt_path)


ckpt = {}
if resume:  # rank 0 reads the file; the weights and optimizer state reach the other ranks' shards by broadcast
    ckpt = torch.load(ckpt_path, weights_only=True) if master else {"model": {}, "optim": {}}
    set_state_dict(policy, optimizer, model_state_dict=ckpt.pop("model"), optim_state_dict=ckpt.pop("optim"),
                   options=full_state)
    if master:
        torch.set_rng_state(ckpt["torch_rng"])
box = [ckpt.get("version", 0)]
dist.broadcast_object_list(box, src=0)
start = box[0]  # version k = the weights after k optimizer steps: this run's first batch is trained at version start


def full_weights():
    for name, p in policy.state_dict().items():
        yield name, (p.full_tensor() if isinstance(p, DTensor) else p)  # a collective on every rank


def token_versions(completion):
    """The policy version that sampled each token (vLLM's spans of [start, end) per version)."""
    v = [0] * len(completion["ids"])
    for version, start, end in completion["spans"]:
        v[start:end] = [version] * (end - start)
    return v


def pad(rows, width):
    return torch.tensor([r + [0.0] * (width - len(r)) for r in rows], device=device)


class Stopped(Exception):
    """Ctrl-C or SIGTERM (torchrun passes both on to every rank): stop at the next step boundary."""


stop_signal = 0


def on_signal(signum, frame):
    global stop_signal
    stop_signal = signum


signal.signal(signal.SIGINT, on_signal)
signal.signal(signal.SIGTERM, on_signal)
# -----------------------------------------------------------------------------------------------------------------
if master:
    import rollout  # noqa: F401  (fail here, not in the child, if the rollout module is broken)
    os.makedirs(out_dir, exist_ok=True)
    json.dump(config, open(os.path.join(out_dir, "train_config.json"), "w"), indent=1)  # config.json is the model's
    env = {k: v for k, v in os.environ.items()  # vLLM must not mistake itself for a torchrun rank
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                        "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE", "OMP_NUM_THREADS")
           and not k.startswith("TORCHELASTIC")}
    if device != "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ",".join(rollout_gpus)
    if rollout_cpus:
        env.update(VLLM_CPU_OMP_THREADS_BIND=rollout_cpus, OMP_NUM_THREADS=str(len(rollout_affinity)))
    proc = subprocess.Popen([sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "rollout.py"),
                             json.dumps(config)], env=env, preexec_fn=lambda: os.sched_setaffinity(0, rollout_affinity))

    def check_alive():
        if stop_signal:
            raise Stopped()
        if proc.poll() is not None:
            raise RuntimeError(f"the rollout process (pid {proc.pid}) exited with code {proc.returncode}; "
                               "its own error is printed above")

    discarded = 0  # since this run started (the rollout process counts its admissions from there too)
    consumed = set(ckpt.get("done", []))  # prompt stream positions taken out of the buffer, trained or discarded
    stream_next = ckpt.get("next", 0)  # ... and every position below this one

    def on_discard(n):  # tell the rollout process a group was discarded, so it can admit a replacement
        global discarded
        discarded += n
        sync.send_header(ctl, version, discarded, device=device)

    buffer = buf.Buffer(max_staleness, drop_flat, on_discard)
    evals, rollout_stats, idle_at = [], {}, None  # idle_at: [version, discarded] when vLLM said it had nothing to do

    def receive():  # trajectories and eval results from the rollout process
        global idle_at
        try:
            while True:
                msg = sync.recv_obj(traj, 1, device)
                idle_at = msg.get("idle")
                rollout_stats.update({k: v for k, v in msg.items() if k.startswith("rollout_") or k in
                                      ("reward_failed", "skipped_long")})
                if msg["kind"] == "group":
                    buffer.put(msg)
                elif msg["kind"] == "eval":
                    evals.append(dict(msg, elapsed_s=time.perf_counter() - t_start))  # when it finished
                elif msg["kind"] == "bye":
                    return
        except Exception as e:
            buffer.fail(f"lost the rollout process: {e}")

    metrics_path = os.path.join(out_dir, "metrics.jsonl")
    kept = [line for line in open(metrics_path) if json.loads(line)["step"] < start] \
        if resume and os.path.exists(metrics_path) else []
    log = open(metrics_path, "w")  # a fresh run, a fresh log; a resumed one keeps what led up to its checkpoint
    log.writelines(kept)

    def log_eval(e):
        print(f"eval @ version {e['version']}: accuracy {e['eval_accuracy']:.3f} (n={e['eval_n']})", flush=True)
        log.write(json.dumps({"step": e["version"], "version": e["version"], "eval_accuracy": e["eval_accuracy"],
                              "eval_n": e["eval_n"], "elapsed_s": e["elapsed_s"]}) + "\n")

    def resume_state():  # what rank 0 needs to continue exactly where this version left off
        global stream_next
        while stream_next in consumed:
            consumed.remove(stream_next)
            stream_next += 1
        return {"next": stream_next, "done": sorted(consumed), "samples": samples, "gen_tokens": gen_tokens,
                "elapsed_s": time.perf_counter() - t_start, "dropped": [buffer.dropped_stale, buffer.dropped_flat]}

    buffer.dropped_stale, buffer.dropped_flat = ckpt.get("dropped", [0, 0])
samples, gen_tokens = ckpt.get("samples", 0), ckpt.get("gen_tokens", 0)
skipped_steps = bad_in_a_row = 0
version = step = start
t_start = time.perf_counter() - ckpt.get("elapsed_s", 0.0)
try:
    if master:
        try:
            ctl, traj, store = sync.connect(rollout_host, rollout_port, 0, device, timeout_s, check_alive)
        except (RuntimeError, TimeoutError) as e:  # port taken, or the rollout process died while starting
            die(str(e))
        sync.send_obj(ctl, {"meta": meta, "version": start, "next": stream_next, "done": sorted(consumed)}, 1, device)
        threading.Thread(target=receive, daemon=True).start()
    if start > 0:  # resumed: the rollout process generates from the checkpointed weights
        if master:
            sync.send_header(ctl, start, 0, has_weights=True, device=device)
        sync.send_weights(ctl if master else None, full_weights(), buckets, getattr(torch, rollout_dtype), device)
    for step in range(start, max_steps):
        version = step
        # ---- 1. a batch: generated by the rollout process while we trained the previous one ----
        t0 = time.perf_counter()
        batch = None  # rank 0 sends None to every rank to stop the run at this step boundary
        if master and not stop_signal:
            try:
                groups, seen, t_wait = buffer.get(version, batch_groups, check_alive)
                n_tok = sum(len(c["ids"]) for g in groups for c in g["completions"])  # flat groups' tokens too
                batch = buf.split(buf.worth_a_forward(groups, world, kl_coef > 0), world), n_tok
            except Stopped:
                pass
        box = [batch]
        dist.broadcast_object_list(box, src=0)
        if box[0] is None:  # Ctrl-C or SIGTERM: stop between two steps, where the state is whole
            if ckpt_every:
                save_checkpoint(version, resume_state() if master else None)
            raise Stopped()
        shards, n_tok = box[0]
        mine, n_tok = shards[rank], torch.tensor([float(n_tok)], device=device)
        t_wait = time.perf_counter() - t0 if not master else t_wait
        # ---- 2. loss and one optimizer step ----
        t0 = time.perf_counter()
        sums, borrowed = torch.zeros(7, device=device), 0  # see the names in step 4
        for i in range(0, len(mine), micro_batch_groups):
            mb = mine[i:i + micro_batch_groups]
            if borrow:  # vLLM is idle until it gets the next weights or a discard notice: use its cores meanwhile
                lent = idle_at == [version, discarded]
                borrowed += lent
                torch.set_num_threads(base_threads + borrow * lent)
            policy.set_requires_gradient_sync(i + micro_batch_groups >= len(mine))
            width = 0  # one rank: completions in chunks of similar length
            if world > 1:  # FSDP's collectives need the same forward calls on every rank: one chunk, one width
                width = torch.tensor([max(len(c["ids"]) for g in mb for c in g["completions"])], device=device)
                dist.all_reduce(width, op=dist.ReduceOp.MAX)
                width = int(width)
            logp, mask = L.token_logprobs(policy, mb, temperature, device, width=width)
            behav = pad([c["logprobs"] for g in mb for c in g["completions"]], logp.shape[1])
            adv = torch.cat([L.group_advantages(torch.tensor([c["reward"] for c in g["completions"]], device=device),
                                                len(g["completions"]), adv_norm_std) for g in mb])
            ref_logp = None
            if reference is not None:
                with torch.no_grad():
                    ref_logp, _ = L.token_logprobs(reference, mb, temperature, device, width=width)
            loss, trunc = L.grpo_loss(logp, behav, adv, mask, n_tok, tis_cap, ref_logp, kl_coef)
            (loss * world).backward()  # FSDP averages gradients over ranks; the loss is already a global token mean
            # tokens sampled by the weights trained right now (staleness 0) vs by older ones
            fresh = (pad([token_versions(c) for g in mb for c in g["completions"]], logp.shape[1]) == step) & (mask > 0)
            stale = (mask > 0) & ~fresh
            shift = (logp.detach() - behav).abs()  # |log rho|
            sums += torch.tensor([loss.item(), (trunc & fresh).sum(), fresh.sum(), (trunc & stale).sum(), stale.sum(),
                                  (shift * fresh).sum(), (shift * stale).sum()], device=device)
        grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), grad_clip)
        grad_norm = grad_norm.full_tensor() if isinstance(grad_norm, DTensor) else grad_norm
        if torch.isfinite(grad_norm):  # the same on every rank: the norm is global
            optimizer.step()
            bad_in_a_row = 0
        else:  # a NaN/inf gradient would poison the weights (and vLLM's copy): skip the step, stop if it persists
            skipped_steps, bad_in_a_row = skipped_steps + 1, bad_in_a_row + 1
            print(f"warning: step {step}: gradient norm {grad_norm.item()}, optimizer step skipped", file=sys.stderr)
            if bad_in_a_row >= max_bad_steps:
                raise FloatingPointError(f"{bad_in_a_row} optimizer steps in a row had a NaN/inf gradient; lower lr "
                                         f"or check the data (max_bad_steps={max_bad_steps})")
        optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(sums)
        t_train = time.perf_counter() - t0
        version = step + 1
        # ---- 3. new weights to the rollout process, which loads them without stopping generation ----
        t0 = time.perf_counter()
        if master:
            sync.send_header(ctl, version, discarded, has_weights=True, device=device)
        sync.send_weights(ctl if master else None, full_weights(), buckets, getattr(torch, rollout_dtype), device)
        t_sync = time.perf_counter() - t0
        # ---- 4. log ----
        if master:
            comps = [(g, c) for g in groups for c in g["completions"]]
            stale = [step - c["version_min"] for g, c in comps]
            samples += len(comps)
            gen_tokens += sum(len(c["ids"]) for g in seen for c in g["completions"])
            rewards = [c["reward"] for g in seen for c in g["completions"]]  # what the policy got, flat groups too
            m = {"step": step, "version": version, "reward_mean": sum(rewards) / len(rewards),
                 "accuracy": sum(r == 1.0 for r in rewards) / len(rewards),
                 "response_len_mean": sum(len(c["ids"]) for g, c in comps) / len(comps),
                 "staleness_mean": sum(stale) / len(stale), "staleness_max": max(stale),
                 "mixed_version_frac": sum(c["version_min"] != c["version_max"] for g, c in comps) / len(comps),
                 "dropped_stale": buffer.dropped_stale, "dropped_flat": buffer.dropped_flat,
                 "flat_frac": sum(map(buf.is_flat, groups)) / len(groups),  # in the batch (drop_flat=False), not run
                 # off-policy health: the training-inference mismatch |log pi_theta - log pi_vllm| on fresh tokens
                 # (same weights: numerics only, ~0 in fp32), how far the policy has moved from the stale tokens'
                 # sampler, and the share of fresh and of stale tokens whose importance weight hit tis_cap
                 "loss": sums[0].item(), "logprob_mismatch": (sums[5] / sums[2]).item() if sums[2] else None,
                 "logprob_shift_stale": (sums[6] / sums[4]).item() if sums[4] else None,  # None: no such tokens
                 "trunc_frac": ((sums[1] + sums[3]) / (sums[2] + sums[4])).item(),
                 "trunc_frac_fresh": (sums[1] / sums[2]).item() if sums[2] else None,
                 "trunc_frac_stale": (sums[3] / sums[4]).item() if sums[4] else None,
                 "stale_token_frac": (sums[4] / (sums[2] + sums[4])).item(), "grad_norm": grad_norm.item(),
                 "train_tokens_per_s": (sums[2] + sums[4]).item() / t_train, "skipped_steps": skipped_steps,
                 "samples": samples, "gen_tokens": gen_tokens, "t_wait_s": t_wait, "t_train_s": t_train,
                 "t_sync_s": t_sync, "elapsed_s": time.perf_counter() - t_start,
                 # the share of this step's micro-batches that also ran on vLLM's cores (borrow_cpus)
                 "borrowed_frac": borrowed / max(len(range(0, len(mine), micro_batch_groups)), 1),
                 "prompts": sorted(g["pos"] for g in groups),  # prompt stream positions trained in this step
                 "trainer_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, **rollout_stats}
            print(f"step {step:4d} | reward {m['reward_mean']:.3f} | acc {m['accuracy']:.3f} | "
                  f"stale {m['staleness_mean']:.2f}/{m['staleness_max']} | {m['train_tokens_per_s']:.0f} tok/s | "
                  f"wait {t_wait:.2f}s train {t_train:.2f}s sync {t_sync:.2f}s", flush=True)
            consumed.update(g["pos"] for g in seen)
            log.write(json.dumps(m) + "\n")
            while evals:
                log_eval(evals.pop(0))
            log.flush()
        if ckpt_every and version % ckpt_every == 0:
            save_checkpoint(version, resume_state() if master else None)
    # ---- the end: the final eval, the model in Hugging Face format ----
    if ckpt_every and version % ckpt_every:
        save_checkpoint(version, resume_state() if master else None)
    full = {name: t.cpu() for name, t in full_weights()}
    if master:
        AutoTokenizer.from_pretrained(model).save_pretrained(out_dir)
        policy.save_pretrained(out_dir, state_dict=full)
        deadline = time.time() + timeout_s
        while eval_every > 0 and not any(e["version"] == max_steps for e in evals) and time.time() < deadline:
            check_alive()
            time.sleep(0.1)
        for e in evals:
            log_eval(e)
        log.close()
        sync.send_header(ctl, max_steps, discarded, stop=True, device=device)
        try:
            print("curves:", plot(out_dir))
        except ImportError:  # matplotlib is optional
            pass
        proc.wait(timeout=timeout_s)
except Stopped:
    if master:
        saved = f"; checkpoint at version {version} in {ckpt_path}, continue with --resume" if ckpt_every else ""
        print(f"stopped by {signal.Signals(stop_signal).name} at step {step}{saved}", file=sys.stderr, flush=True)
    sys.exit(128 + stop_signal)
except Exception as e:
    if not master:
        raise
    try:  # a broken connection usually means the rollout process died: say so, with its exit code
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        raise e
    print(f"error: the rollout process (pid {proc.pid}) exited with code {proc.returncode}, so training stopped at "
          f"step {step} ({type(e).__name__}: {str(e)[:200]}); its own error, if any, is printed above", file=sys.stderr)
    sys.exit(1)
finally:
    if master and proc.poll() is None:
        proc.kill()
        proc.wait()
dist.destroy_process_group()
