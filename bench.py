"""bench.py: how fast the pipeline runs, one mode at a time. Each prints what it measured and one
JSON line; the results log (docs/LOG.md) keeps what they said, with the machine.

  python bench.py [MODE] [--key=value ...]     (the modes: MODES at the end of this file)

Measured side by side in one invocation, as ratios: absolute times are noise on a shared
machine. The first `--warmup` steps of a run (engine start, first batch) are left out.
"""
import json
import os
import shutil
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.abspath(__file__))
args = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--") and "=" in a)
warmup = int(args.get("warmup", 2))
# lr=0: the weights still go through AdamW and on to vLLM every step, but the policy stays put, so
# that two runs generate answers of the same lengths and do the same work per sample (learning
# would shorten the answers at a different pace in each). borrow_cpus=False: each side keeps its
# own core, a fixed split of the machine.
# name: (config, overrides, the `prepare.py` target that makes its model)
CONFIGS = {"tiny": ("config/tiny.py", ["--max_steps=12", "--rollout_cpus=1",
                                       "--lr=0.0", "--borrow_cpus=False"], "tiny"),
           # 4 groups with reward spread per step, the eval on 100 sums
           "smollm": ("config/smollm_cpu.py",
                      ["--max_steps=4", "--batch_groups=4", "--drop_flat=True", "--eval_n=100",
                       "--lr=0.0", "--borrow_cpus=False"], "smollm2"),
           # the agent demo: multi-turn answers with a calculator, whose tails are longest (all
           # groups trained: at lr=0 most would be flat, and waiting for others is not overlap)
           "calc": ("config/smollm_calc.py", ["--max_steps=5", "--batch_groups=4", "--lr=0.0",
                                              "--drop_flat=False", "--borrow_cpus=False"],
                    "smollm2")}
SMI = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"]
GPUS = shutil.which(SMI[0]) and len(subprocess.run(SMI, capture_output=True, text=True)
                                    .stdout.split()) or 0


# ---- helpers ------------------------------------------------------------------------------------
def mean(xs):
    return sum(xs) / len(xs)


def prepare(name):  # the config's model, made offline once (a no-op when it is there)
    subprocess.run([sys.executable, "prepare.py", CONFIGS[name][2]], cwd=ROOT, check=True,
                   stdout=subprocess.DEVNULL)


def run_dir(name, overrides):
    return os.path.join(ROOT, "out/bench",
                        name + "".join(o.replace("--", "_").replace("=", "") for o in overrides))


def free_port():  # (a fixed range could meet rollout_port's 29600)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(config, out, overrides, nodes=1, cwd=ROOT, **kw):
    """train.py on one rank per node (nodes > 1: torchrun agents on this machine) into `out`
    -> (its step rows, the processes)."""
    os.makedirs(out, exist_ok=True)
    open(os.path.join(out, "metrics.jsonl"), "w").close()
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}",
                               "--nproc_per_node=1", "--master_addr=127.0.0.1",
                               f"--master_port={port}", f"--node_rank={n}", "train.py", config,
                               f"--out_dir={out}", "--ckpt_every=0", *overrides], cwd=cwd, **kw)
             for n in range(nodes)]
    for p in procs:
        p.outputs = p.communicate()  # (stdout, stderr), where they were asked for
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    return [r for r in rows if "loss" in r], procs


def train(name, *overrides, nodes=1, env=None):  # a CONFIGS run, eval off -> its step rows
    config, base, _ = CONFIGS[name]
    out = run_dir(name + ("_two_nodes" if nodes > 1 else ""), overrides)
    rows, procs = launch(config, out, [*base, "--eval_every=0", *overrides], nodes=nodes,
                         env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if any(p.returncode for p in procs):
        sys.exit(f"a run failed: {out}")
    return rows


def vllm_env(cores="1", gpu=None):  # vLLM alone, on the cores (or the GPU) the loop's engine had
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_LOGGING_LEVEL="ERROR")
    if gpu is not None:
        return dict(env, CUDA_VISIBLE_DEVICES=str(gpu))
    return dict(env, VLLM_CPU_OMP_THREADS_BIND=cores, OMP_NUM_THREADS=str(len(cores.split(","))))


def vllm_alone(what, cfg_path, *extra, env=None, timeout=900):  # peers/vllm_alone.py -> its JSON
    pin = [] if GPUS else ["taskset", "-c", env.get("VLLM_CPU_OMP_THREADS_BIND", "1")]
    try:
        out = subprocess.run([*pin, sys.executable, "peers/vllm_alone.py", what, cfg_path,
                              *map(str, extra)], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        sys.exit(f"vLLM alone did not finish in {timeout} s:\n{(e.stderr or '')[-3000:]}")
    if out.returncode:
        sys.exit(f"vLLM alone failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def per_sample(rows):
    a, b = rows[warmup - 1], rows[-1]
    return (b["elapsed_s"] - a["elapsed_s"]) / (b["samples"] - a["samples"])


# ---- the default mode: the pipeline's ratios ---------------------------------------------------
def ratios():
    """Per config (--configs=tiny,smollm; --overlap: the first ratio only):
      overlap_speedup     wall-clock per trained sample, synchronous (max_staleness=0) /
                          asynchronous (the config's eta), vLLM and the trainer on their own cores;
                          overlap_bound = (T_gen + T_train) / max(T_gen, T_train), from the
                          synchronous run's own timings (there, waiting = generating)
      sync_ratio          trainer-blocked time to push the model to a real vLLM engine (its
                          snapshot filled; a thread sends it, a broadcast per bucket into the
                          engine's staging copy) / one raw broadcast of the same bytes to it
      rollout_pause_share time the engine spends loading weights / time it spends generating
      rollout_efficiency  vLLM tokens/s inside the loop / vLLM alone on the loop's prompts, with
                          the same sampling, (eta + 1) * batch_groups groups at once (the most
                          admission lets an engine hold)
      trainer_idle_share  the asynchronous trainer's share of wall-clock spent waiting for data"""
    results = {}
    for name in args.get("configs", "tiny,smollm").split(","):
        prepare(name)
        sync_rows = train(name, "--max_staleness=0")
        async_rows = train(name)
        steady = async_rows[warmup:]
        t_gen = mean([r["t_wait_s"] for r in sync_rows[warmup:]])
        t_train = mean([r["t_train_s"] + r["t_sync_s"] for r in sync_rows[warmup:]])
        r = results[name] = {"overlap_speedup": per_sample(sync_rows) / per_sample(async_rows),
                             "overlap_bound": (t_gen + t_train) / max(t_gen, t_train),
                             "t_gen_s": t_gen, "t_train_s": t_train,
                             "turns_mean": mean([x["turns_mean"] for x in steady])}
        if "--overlap" in sys.argv:
            continue
        last = async_rows[-1]
        in_loop = last["rollout_tokens"] / (last["rollout_engine_s"] + last["rollout_load_s"])
        cfg_path = os.path.join(run_dir(name, []), "train_config.json")
        cfg = json.load(open(cfg_path))
        in_flight = min(cfg["rollout_seqs"] // cfg["group_size"],
                        (cfg["max_staleness"] + 1) * cfg["batch_groups"])
        alone = vllm_alone("generate", cfg_path, in_flight, 0, env=vllm_env())["defaults"]
        pushed, raw, nbytes = weight_sync(cfg["model"])
        r.update(sync_ratio=pushed / raw, sync_s=pushed, sync_raw_s=raw, weight_mb=nbytes / 2**20,
                 rollout_pause_share=last["rollout_load_s"] / last["rollout_engine_s"],
                 rollout_efficiency=in_loop / alone, rollout_tokens_per_s=in_loop,
                 trainer_idle_share=(sum(x["t_wait_s"] for x in steady)
                                     / sum(x["t_wait_s"] + x["t_train_s"] + x["t_sync_s"]
                                           for x in steady)),
                 trainer_tokens_per_s=mean([x["train_tokens_per_s"] for x in steady]))
    for name, r in results.items():
        print(f"\n{name}\n" + "\n".join(f"  {k:24s} {v:.3f}" if isinstance(v, float) else
                                         f"  {k:24s} {v}" for k, v in r.items()))
    print(json.dumps(results[name] | {"config": name, "per_config": results}))


def weight_sync(model_dir, repeats=5, lora_rank=0, loaded=None):
    """Trainer-side seconds to push a model (lora_rank > 0: its adapter) into a real vLLM engine
    (Sender.push, then its load: peers/weight_peer.py) vs one raw broadcast of the same bytes to
    the same worker. -> medians and the bytes; `loaded`: a list, gets the seconds from the push
    to the engine's load done."""
    import torch
    from transformers import AutoModelForCausalLM
    import lora
    import sync
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    port = free_port()
    store = sync.open_store("127.0.0.1", port, True, 60)
    cfg = {"rollout_dtype": "float32", "colocate": False, "timeout_s": 60, "rollout_port": port,
           "tensor_parallel_size": 1, "stage_weights": True, "lora_rank": lora_rank,
           "lora_alpha": 32, "lora_targets": "all-linear"}
    if lora_rank:
        model = lora.add(model, cfg, torch.float32)
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    peer = subprocess.Popen([sys.executable, "peers/weight_peer.py", model_dir, str(port),
                             str(repeats), str(lora_rank)], cwd=ROOT, env=vllm_env())
    meta = [(n, tuple(p.shape)) for n, p in trained]
    ctls, _ = sync.connect(store, 0, 1, 60)
    sender = sync.Sender(store, sync.plan(meta, torch.float32), cfg, torch.device("cpu"), ctls)
    flat = torch.zeros(sum(n for _, n, _ in sender.plan))
    store.set("numel", str(flat.numel()))
    pushed, raw = [], []
    with torch.no_grad():
        for i in range(repeats):
            t = time.perf_counter()
            sender.push(iter(trained), i)
            pushed.append(time.perf_counter() - t)
            store.wait([f"loaded{i}"])  # the sender's thread is done with the group
            if loaded is not None:
                loaded.append(time.perf_counter() - t)
            t = time.perf_counter()
            store.set(f"raw{i}", "1")
            sender.links[0][1].broadcast(flat, 0).wait()
            raw.append(time.perf_counter() - t)
    peer.wait(timeout=60)
    return sorted(pushed)[repeats // 2], sorted(raw)[repeats // 2], flat.numel() * 4


# ---- --trainer, --varlen: peers/trainer_step.py (it runs under torchrun) ------------------------
def trainer_step(fn):  # -> its main(args) or varlen_check()
    sys.path.insert(0, os.path.join(ROOT, "peers"))
    import trainer_step
    return trainer_step.main(args) if fn == "main" else trainer_step.varlen_check()


# ---- --engine: the engine loop against vLLM alone ---------------------------------------------
# the loop as the trainer sees it: synchronous (the trainer waits for every whole batch), lr=0 (the
# same answers every run), graded by the default 2 grader processes; vLLM alone on core 1 (the
# trainer on core 0), or on a GPU with CUDA graphs as the GPU recipes run: GPU 1, or the trainer's
# GPU shared (colocate) on a one-GPU machine
ENGINE_RUN = ["--max_staleness=0", "--lr=0.0", "--eval_every=0", "--drop_flat=False",
              "--group_size=8", "--max_new_tokens=64", "--borrow_cpus=False", "--temperature=1.0",
              *(["--rollout_cpus=", "--enforce_eager=False"] if GPUS else ["--rollout_cpus=1"]),
              *(["--colocate=True", "--gpu_memory_utilization=0.3"] if GPUS == 1 else [])]
ENGINE_SHAPE = {"tiny": (32, 8), "smollm": (16, 4)}  # groups of 8 in flight, steps


def engine():
    """The loop's generation as the trainer waits for it (generated tokens / t_wait_s at eta=0,
    so that it waits for every whole batch) and inside vLLM's step (rollout_tokens /
    rollout_engine_s), against LLM.generate alone on the batches of the same steps, with the
    same sampling, concurrency, engine settings and core (a GPU: its GPU, CUDA graphs on):
    in-process at vLLM's defaults, in-process with the loop's output settings, and with vLLM's
    engine core in a process of its own. Then a py-spy profile of the loop (--profile=0: off).
    --configs=tiny,smollm; --runs=N."""
    runs, results = int(args.get("runs", 1)), {}
    env = vllm_env(gpu=0 if GPUS == 1 else 1) if GPUS else vllm_env()
    for name in args.get("configs", "tiny,smollm").split(","):
        prepare(name)
        G, S = ENGINE_SHAPE[name]
        r = {"in_flight": G * 8, "loop": [], "loop_in_step": [], "generate_in_process": [],
             "generate_loop_outputs": [], "generate_engine_process": []}
        for _ in range(runs):
            overrides = [*ENGINE_RUN, f"--batch_groups={G}", f"--rollout_seqs={G * 8}",
                         f"--max_steps={S}"]
            rows = train(name, *overrides)
            a, b = rows[warmup - 1], rows[-1]
            r["loop"].append((b["gen_tokens"] - a["gen_tokens"])
                             / sum(x["t_wait_s"] for x in rows[warmup:]))
            r["loop_in_step"].append((b["rollout_tokens"] - a["rollout_tokens"])
                                     / (b["rollout_engine_s"] - a["rollout_engine_s"]))
            print(f"{name}: the loop {r['loop'][-1]:.0f} tokens/s as the trainer waits, "
                  f"{r['loop_in_step'][-1]:.0f} inside vLLM's step", flush=True)  # if vLLM hangs
            cfg_path = os.path.join(run_dir(name, overrides), "train_config.json")
            steps = ",".join(map(str, range(warmup, S)))
            inproc = vllm_alone("generate", cfg_path, G, steps, "defaults,loop_outputs", env=env)
            r["generate_in_process"].append(inproc["defaults"])
            r["generate_loop_outputs"].append(inproc["loop_outputs"])
            r["generate_engine_process"].append(vllm_alone(
                "generate", cfg_path, G, steps, env=dict(env, VLLM_ENABLE_V1_MULTIPROCESSING="1")
            )["defaults"])
        best = max(max(r[k]) for k in r if k.startswith("generate"))
        r["loop_vs_fastest_vllm"] = [x / best for x in r["loop"]]
        r["profile"] = profile(name, G) if args.get("profile", "1") == "1" else "off"
        results[name] = r
    for name, r in results.items():
        print(f"\n{name} ({r['in_flight']} sequences in flight), generated tokens/s")
        for k, v in r.items():
            if isinstance(v, list):
                print(f"  {k:24s} " + ", ".join(f"{x:.3g}" for x in v))
        print(f"  {'loop profile':24s} {r['profile']}")
    print(json.dumps(results))


def profile(name, G, seconds=20):  # py-spy on a loop run's engine (peers/loop_profile.py)
    from peers.loop_profile import profile as spy
    config, base, _ = CONFIGS[name]
    out = run_dir(name + "_profile", [])
    return spy([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", "train.py",
                config, *base, *ENGINE_RUN, f"--batch_groups={G}", f"--rollout_seqs={G * 8}",
                "--max_steps=1000", f"--out_dir={out}", "--ckpt_every=0"], out, ROOT, seconds)


# ---- --trl: TRL's GRPOTrainer on the same machine ---------------------------------------------
def trl():
    """TRL's GRPOTrainer (peers/trl_grpo.py; pip install trl datasets) on the demo's task and
    model, 16 prompts x 8 samples of at most 64 tokens per step, fp32, lr 2e-5, against ours at
    the same batch (--batch_groups=16 --drop_flat=False, the demo's other settings). Samples/s
    and generated tokens/s over the steps after the first. --steps=4."""
    steps = int(args.get("steps", 4))
    prepare("smollm")
    out = subprocess.run([sys.executable, "peers/trl_grpo.py", f"{ROOT}/data/smollm2-135m",
                          f"{ROOT}/out/bench/trl", str(steps)], cwd=ROOT, capture_output=True,
                         text=True)
    if out.returncode:
        sys.exit(f"TRL failed (pip install trl datasets?):\n{out.stderr[-2000:]}")
    theirs = json.loads(out.stdout.strip().splitlines()[-1])
    ours = train("smollm", f"--max_steps={steps}", "--batch_groups=16", "--drop_flat=False",
                 "--lr=2e-5", "--borrow_cpus=True", "--eval_n=100")
    ours_step_s = [r["t_wait_s"] + r["t_train_s"] + r["t_sync_s"] for r in ours]
    ours_len = [r["response_len_mean"] for r in ours]
    # the answers shorten as the policy learns, at another pace in each: compare tokens/s too
    rate = lambda lens, secs: 128 * sum(lens[1:]) / sum(secs[1:])  # after the first step
    trl_s, ours_s = mean(theirs["trl_step_s"][1:]), mean(ours_step_s[1:])
    trl_tok, ours_tok = rate(theirs["lengths"], theirs["trl_step_s"]), rate(ours_len, ours_step_s)
    print(json.dumps({"trl_step_s": theirs["trl_step_s"], "trl_reward": theirs["rewards"],
                      "trl_len": theirs["lengths"], "ours_step_s": ours_step_s,
                      "ours_reward": [r["reward_mean"] for r in ours], "ours_len": ours_len,
                      "trl_samples_per_s": 128 / trl_s, "ours_samples_per_s": 128 / ours_s,
                      "speedup": trl_s / ours_s, "trl_tokens_per_s": trl_tok,
                      "ours_tokens_per_s": ours_tok, "speedup_tokens": ours_tok / trl_tok}))


# ---- --grading: graders against the recipe's answer rate -------------------------------------
# the GPU recipe's answer rate, an estimate (not measured): an H100 engine making ~30k tokens/s
# of Qwen2.5-1.5B at 1024 sequences, GSM8K answers ~300 tokens: ~100 answers/s per engine
RECIPE_ANSWERS_PER_S = 30_000 / 300


def grading():
    """Workers: math-verify answers/s on GSM8K-style answers (a few sentences of working, then a
    boxed number) with 1 and 2 processes, collected by a loop that stands in for the engine's (a
    2 ms step, then Workers.wait and poll), against the GPU recipe's answer rate; then the tiny run
    with a 50 ms grader (peers/slow_grader in every process): the loop's tokens/s while stepping
    or grading, and the share of that time spent on grades."""
    import reward
    out = {"recipe_answers_per_s_per_engine (estimate)": RECIPE_ANSWERS_PER_S}
    working = ("Natalia sold {i} clips in April and half as many in May, so she sold {i} / 2 = "
               "{h} clips in May. Altogether she sold {i} + {h} = {t} clips in April and May. ")
    answers = [(working.format(i=2 * i, h=i, t=3 * i) * 4 + f"The answer is \\boxed{{{3 * i}}}.",
                str(3 * i)) for i in range(1000)]
    for workers in (1, 2):
        graders = reward.Workers(workers, 5.0)
        for i in range(workers):  # each process imports math-verify once
            graders.submit(i, reward.grade_math, "\\boxed{1}", "1")
        while graders.running:
            graders.wait(1.0)
            graders.poll()
        t, done = time.perf_counter(), 0
        for i, (text, answer) in enumerate(answers):
            graders.submit(i, reward.grade_math, text, answer)
        while done < len(answers):
            time.sleep(0.002)
            graders.wait(1.0)
            done += len(graders.poll())
        rate = len(answers) / (time.perf_counter() - t)
        out[f"math_verify_answers_per_s_{workers}"] = rate
        out[f"capacity_vs_recipe_{workers}"] = rate / RECIPE_ANSWERS_PER_S
        graders.close()
    hook = os.pathsep.join([f"{ROOT}/peers/slow_grader", ROOT])
    m = train("tiny", "--max_steps=6", env=dict(os.environ, PYTHONPATH=hook))[-1]
    busy = m["rollout_engine_s"] + m["rollout_grade_s"]
    out["slow_grader_tokens_per_s"] = m["rollout_tokens"] / busy
    out["slow_grader_grade_share"] = m["rollout_grade_s"] / busy
    print(json.dumps(out))


# ---- --gpu: the whole GPU path in minutes -----------------------------------------------------
def gpu():
    """For a machine with GPUs: the tiny model and SmolLM2 (when data/smollm2-135m is there) in
    fp32, bf16 and fp16, 6 steps at eta = 1 (loads land during generation): colocated on GPU 0; the
    separate-GPU path (a staging copy, a receive thread, NCCL): on GPU 1 where there are 2
    GPUs, else on the trainer's own GPU as a second process with the weights over gloo (NCCL
    refuses two ranks on one device; NANOASYNC_SHARE_GPU=1); paused pushes (stage_weights=False).
    Per run: whether it ran, logprob_mismatch and its k3 KL (largest over steps, on completions
    the trained weights computed entirely), generation tokens/s in the loop, seconds per push,
    peak memory per GPU (nvidia-smi, every 0.5 s). No GPU: the tiny model on CPU, to check this
    command itself."""
    import threading
    smollm = GPUS and os.path.isdir(f"{ROOT}/data/smollm2-135m")
    models = {"tiny": "config/tiny.py", **({"smollm": "config/smollm_cpu.py"} if smollm else {})}
    pick = lambda key, all_: [x for x in args.get(key, all_).split(",") if x in all_.split(",")]
    prepare("tiny")
    rows = []
    for name in pick("models", ",".join(models)):
        config = models[name]
        for dtype in pick("dtypes", "float32,bfloat16,float16"):
            for mode in pick("modes", "colocate,separate,paused"):
                over = [f"--rollout_dtype={dtype}", f"--trainer_dtype={dtype}", "--max_steps=6",
                        "--max_staleness=1", "--rollout_cpus=", "--eval_every=0",
                        f"--colocate={mode == 'colocate'}", f"--stage_weights={mode != 'paused'}",
                        "--gpu_memory_utilization=0.3", f"--lora_rank={args.get('lora_rank', 0)}"]
                env = dict(os.environ, NANOASYNC_SHARE_GPU="1") if GPUS == 1 else None
                out = run_dir(f"gpu_{name}_{dtype}_{mode}_lora{args.get('lora_rank', 0)}", [])
                peak, done = [0] * GPUS, threading.Event()

                def watch():  # peak memory per GPU, every process on it
                    while not done.wait(0.5):
                        used = subprocess.run(SMI, capture_output=True, text=True).stdout.split()
                        peak[:] = [max(a, int(b)) for a, b in zip(peak, used)]
                if GPUS:
                    threading.Thread(target=watch, daemon=True).start()
                t0 = time.perf_counter()
                steps, (p,) = launch(config, out, over, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
                done.set()
                row = {"model": name + ("+lora" if args.get("lora_rank", "0") != "0" else ""),
                       "dtype": dtype, "mode": mode, "rc": p.returncode,
                       "wall_s": round(time.perf_counter() - t0, 1), "steps": len(steps)}
                if steps:
                    whole = [r["logprob_mismatch"] for r in steps
                             if r["logprob_mismatch"] is not None]
                    kl = [r["logprob_kl_k3"] for r in steps if r["logprob_kl_k3"] is not None]
                    last = steps[-1]
                    row.update(logprob_mismatch=max(whole, default=None),
                               kl_k3=max(kl, default=None),
                               shift_reloaded=max(r["logprob_shift_reloaded"] or 0 for r in steps),
                               gen_tokens_per_s=round(last["rollout_tokens"]
                                                      / last["rollout_engine_s"]),
                               push_s=round(mean([r["t_sync_s"] for r in steps[1:] or steps]), 3),
                               peak_mb=[round(x) for x in peak])
                if p.returncode:  # the first line that says what went wrong, and where it all is
                    open(os.path.join(out, "stderr.txt"), "w").write(p.outputs[1])
                    said = [x for x in p.outputs[1].splitlines() if "rror" in x] or ["?"]
                    row["error"] = f"{said[0][:300]} (all of it: {out}/stderr.txt)"
                print(json.dumps(row), flush=True)
                rows.append(row)
    print("\nmodel   dtype     mode      rc  steps  mismatch     k3  reloaded  gen tok/s  push s"
          "  peak MB (per GPU)")
    for r in rows:
        print(f"{r['model']:7s} {r['dtype']:9s} {r['mode']:9s} {r['rc']:3d} {r['steps']:5d}  "
              f"{r.get('logprob_mismatch') or 0:8.1e} {r.get('kl_k3') or 0:7.1e}  "
              f"{r.get('shift_reloaded') or 0:8.1e}  {r.get('gen_tokens_per_s', 0):9d}  "
              f"{r.get('push_s', 0):6.3f}  {r.get('peak_mb')}")
    return int(any(r["rc"] for r in rows))


# ---- --precision: the trainer's logprobs against vLLM's, per dtype ------------------------------
def precision():
    """peers/precision.py for each dtype (--dtypes=float32,bfloat16,float16) on SmolLM2 (tiny
    with --models=tiny, or when SmolLM2 is not there), vLLM eager (--eager=False: compiled, as
    the GPU recipes run it): the trainer's logprobs against vLLM's decode logprobs, vLLM's own
    prefill against its decode (the floor), each against float32. fp16 needs a GPU or a CPU
    with avx512_fp16 / AMX-FP16 to be fast (elsewhere its matmuls are emulated)."""
    name = args.get("models", "smollm" if GPUS == 0 or os.path.isdir(f"{ROOT}/data/smollm2-135m")
                    else "tiny")
    prepare(name)
    model = {"tiny": "data/tiny", "smollm": "data/smollm2-135m"}[name]
    rows = []
    for dtype in args.get("dtypes", "float32,bfloat16,float16").split(","):
        for eager in args.get("eager", "True").split(","):
            out = subprocess.run([sys.executable, "peers/precision.py", model, dtype,
                                  args.get("prompts", "4"), "96", eager], cwd=ROOT,
                                 capture_output=True, text=True, timeout=1200)
            if out.returncode:
                sys.exit(f"peers/precision.py {dtype} failed:\n{out.stderr[-3000:]}")
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), flush=True)
    pairs = ("trainer_vs_vllm_decode", "vllm_decode_vs_prefill", "trainer_vs_float32",
             "vllm_decode_vs_float32")
    print(f"\n{'dtype':9s} eager  " + "  ".join(f"{p:>24s}" for p in pairs)
          + "\n" + " " * 16 + "  ".join(f"{'mean |d|':>11s} {'k3':>12s}" for _ in pairs))
    for r in rows:
        print(f"{r['dtype']:9s} {str(r['enforce_eager']):5s}  " + "  ".join(
            f"{r[p]['mean_abs']:11.2e} {r[p]['k3']:12.2e}" for p in pairs))


# ---- --fill: every engine full ------------------------------------------------------------------
def fill():
    """Every engine full, the three engine-side goals (--parts=occupancy,balance,pause):
      occupancy  rollout_running_frac per step (per engine step: training sequences in vLLM /
                 rollout_seqs) with long-tailed answers: SmolLM2, T = 1, 192 new tokens, 64 slots,
                 a budget (eta = 8) that never runs out in 6 steps, lr = 0, every group trained
      balance    each engine's trained groups over 8 asynchronous steps (eta = 1) / a fair share:
                 two engines on one node, then two nodes (two torchrun agents here), tiny model;
                 then two engines, one of them stopped (SIGSTOP) for 4 s of every 8
      pause      the seconds each load paused generation in the occupancy run (rollout_pause_s)
                 / the same copy into vLLM alone (peers/vllm_alone.py copy), median of 5"""
    parts, out = args.get("parts", "occupancy,balance,pause").split(","), {}
    if "occupancy" in parts or "pause" in parts:
        prepare("smollm")
        over = ["--temperature=1.0", "--max_new_tokens=192", "--max_model_len=320",
                "--rollout_seqs=64", "--batch_groups=4", "--max_staleness=8", "--drop_flat=False",
                f"--max_steps={args.get('steps', 6)}"]
        rows = train("smollm", *over)
        out["running_frac"] = [r["rollout_running_frac"] for r in rows]
        out["running_frac_steady"] = mean([x for x in out["running_frac"][warmup:] if x])
        out["response_len_mean"] = [round(r["response_len_mean"]) for r in rows]
        out["cut_frac"] = [r["cut_frac"] for r in rows]
        pauses = [r["rollout_pause_s"] for r in rows if r["rollout_pause_s"]]
        cfg_path = os.path.join(run_dir("smollm", over), "train_config.json")
        out["copy_s"] = vllm_alone("copy", cfg_path, env=vllm_env())["copy_s"]
        out["pause_s"], out["pause_over_copy"] = pauses, mean(pauses) / out["copy_s"]
    if "balance" in parts:
        prepare("tiny")
        over = ["--max_steps=8", "--max_staleness=1"]
        for where, rows in (("one_node", train("tiny", "--rollout_engines=2", *over)),
                            ("two_nodes", train("tiny", *over, nodes=2))):
            per = [sum(r["engine_groups"][e] for r in rows) for e in (0, 1)]
            out[f"balance_{where}"] = {"per_step": [r["engine_groups"] for r in rows],
                                       "share_of_fair": [x / (sum(per) / 2) for x in per]}
    for k, v in out.items():
        print(f"  {k:22s} {v}")
    print(json.dumps(out))


# ---- --env: a slow environment against an instant one --------------------------------------------
def env_speed():
    """`--env [--delay_s=0.05]`: the agent demo (the calculator environment, lr = 0) as it is and
    with each environment step delay_s slower (peers/slow_env.py): the engine's share of slots
    decoding (rollout_running_frac, steady steps) of each, and their ratio. Each answer waits for
    its own reply in its own process; the engine decodes the others meanwhile."""
    prepare("calc")
    delay = args.get("delay_s", "0.05")
    runs = {"instant": train("calc"),
            "slow": train("calc", "--task=env:peers/slow_env.py:SlowCalculator",
                          env=dict(os.environ, ENV_STEP_S=delay))}
    out = {"delay_s": float(delay)}
    for name, rows in runs.items():
        out[name] = mean([r["rollout_running_frac"] for r in rows[warmup:]
                          if r["rollout_running_frac"]])
        out[f"{name}_turns_mean"] = mean([r["turns_mean"] for r in rows])
    out["slow_over_instant"] = out["slow"] / out["instant"]
    for k, v in out.items():
        print(f"  {k:22s} {v}")
    print(json.dumps(out))


# ---- --lora: a push of the adapter against a push of the model ---------------------------------
def lora_push():
    """`--lora [--rank=16] [--runs=2]`: SmolLM2-135M in fp32 into a real engine, the whole model
    then a rank-R adapter on every linear layer, back to back, `runs` times: the bytes, the
    seconds the trainer waits (Sender.push), and the seconds until the engine has loaded it."""
    prepare("smollm")
    rank, rows = int(args.get("rank", 16)), []
    for run in range(int(args.get("runs", 2))):
        for r in (0, rank):
            loaded = []
            pushed, _, nbytes = weight_sync("data/smollm2-135m", lora_rank=r, loaded=loaded)
            row = {"run": run, "lora_rank": r, "push_bytes": nbytes, "push_s": round(pushed, 4),
                   "loaded_s": round(sorted(loaded)[len(loaded) // 2], 4)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    print(json.dumps(rows))


# ---- --ab=REV: the demo, this tree against a commit, back to back ------------------------------
def ab():
    """`--ab=REV`: config/smollm_cpu.py --eval_every=0 --max_steps=4 (--steps=N) on commit REV
    (a git worktree under out/bench, sharing .venv and data) and on this tree, back to back:
    REV, this, this, REV. Per run: seconds in all, step 0 (the engines' start, the first batch),
    the steps after it, the trainer's seconds per step, and the rewards (equal rewards: the same
    answers, the same work)."""
    rev, steps = args["ab"], args.get("steps", "4")
    prepare("smollm")
    tree = os.path.join(ROOT, "out/bench", f"ab-{rev}")
    if not os.path.isdir(tree):
        subprocess.run(["git", "worktree", "add", "--detach", tree, rev], cwd=ROOT, check=True)
        for shared in (".venv", "data"):
            os.symlink(os.path.join(ROOT, shared), os.path.join(tree, shared))
    results = []
    for label, cwd in ((rev, tree), ("this", ROOT), ("this", ROOT), (rev, tree)):
        out = os.path.join(ROOT, "out/bench", f"ab_{label}")
        t0 = time.perf_counter()
        rows, _ = launch("config/smollm_cpu.py", out, ["--eval_every=0", f"--max_steps={steps}"],
                         cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        r = {"run": label, "total_s": round(time.perf_counter() - t0, 1),
             "step0_s": round(rows[0]["elapsed_s"], 1),
             "after_s": round(rows[-1]["elapsed_s"] - rows[0]["elapsed_s"], 1),
             "t_train_s": [round(x["t_train_s"], 2) for x in rows],
             "reward": [round(x["reward_mean"], 3) for x in rows]}
        print(json.dumps(r), flush=True)
        results.append(r)
    print(json.dumps(results))


MODES = {  # mode: (function, its usage line)
    "": (ratios, "python bench.py [--configs=tiny,smollm] [--overlap]: the pipeline's ratios"),
    "--trainer": (lambda: trainer_step("main"), "torchrun --nproc_per_node=1 bench.py --trainer [--checkpointing=1] "
                           "[--shared=0] [--compile=0] [--budget=T] [--groups=G] [--tokens=T] "
                           "[--varlen=0] [--profile=1] [--shape=small|1.5b|7b] [--lora_rank=R] "
                           "[--max_gib=G]: the trainer step alone (peers/trainer_step.py)"),
    "--varlen": (lambda: trainer_step("varlen"), "python bench.py --varlen: the GPU's varlen attention against SDPA, "
                         "asserted"),
    "--engine": (engine, "python bench.py --engine [--configs=] [--runs=N] [--profile=0]: the "
                         "engine loop vs vLLM alone (pip install py-spy)"),
    "--trl": (trl, "python bench.py --trl [--steps=4]: TRL's GRPOTrainer vs ours (pip install "
                   "trl datasets)"),
    "--fill": (fill, "python bench.py --fill [--parts=occupancy,balance,pause]: engines full, "
                     "shared, paused"),
    "--grading": (grading, "python bench.py --grading: graders vs the recipe's answer rate"),
    "--gpu": (gpu, "python bench.py --gpu [--models=tiny,smollm] "
                   "[--dtypes=float32,bfloat16,float16] [--lora_rank=R] "
                   "[--modes=colocate,separate,paused]: the whole GPU path in minutes"),
    "--precision": (precision, "python bench.py --precision [--dtypes=float32,bfloat16,float16] "
                               "[--models=smollm|tiny] [--eager=True,False] [--prompts=4]: "
                               "trainer vs vLLM logprobs"),
    "--ab": (ab, "python bench.py --ab=REV [--steps=4]: the demo on REV and on this tree, back "
                 "to back"),
    "--env": (env_speed, "python bench.py --env [--delay_s=0.05]: a slow environment's engine "
                         "vs an instant one's"),
    "--lora": (lora_push, "python bench.py --lora [--rank=16] [--runs=2]: a LoRA push vs a full "
                          "one"),
}

if __name__ == "__main__":
    chosen = [m for m in MODES if m and any(a.split("=")[0] == m for a in sys.argv[1:])]
    if "--help" in sys.argv or len(chosen) > 1:
        sys.exit(__doc__ + "\n".join(usage for _, usage in MODES.values()))
    sys.exit(MODES[chosen[0] if chosen else ""][0]())
