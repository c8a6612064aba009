"""
bench.py: how well the pipeline keeps generation and training busy. Prints a table and one JSON
line.

  python bench.py                  # tiny and SmolLM2 configs on this machine (CPU), < 10 minutes
  python bench.py --configs=tiny   # just the tiny one
  python bench.py --configs=calc --overlap
                                   # the calculator task's overlap alone (multi-turn, ~15 min)
  python bench.py --trl            # TRL's GRPOTrainer vs ours on the demo, same machine
                                   # (pip install trl)
  python bench.py --fill           # every engine full: slot occupancy with long answers, two
                                   # engines' shares (one node, two nodes), a load's pause
  python bench.py --engine         # the engine loop's generation tokens/s against vLLM alone, and
                                   # where the loop's time goes (pip install py-spy); --runs=N;
                                   # on a GPU too (--configs=tiny --profile=0 without py-spy)
  python bench.py --plot OUT_DIR   # OUT_DIR/curves.png from its metrics.jsonl (pip matplotlib);
                                   # --baseline=ACC|RUN_DIR draws a held-out accuracy too
  python bench.py --gpu            # the whole GPU path in minutes, on whatever GPUs are here
                                   # (none: the same runs on CPU); see gpu_check()
  torchrun --nproc_per_node=1 bench.py --trainer
                                   # the trainer step alone, no vLLM: the 1.5B recipe's shape in
                                   # bf16 on a GPU, a small model in fp32 on CPU

Ratios, each measured side by side in one invocation (absolute times are noise on a shared machine):
  overlap_speedup     wall-clock per trained sample, synchronous (max_staleness=0) / asynchronous
                      (the config's eta), with vLLM and the trainer on disjoint cores;
                      overlap_bound = (T_gen + T_train) / max(T_gen, T_train) from the synchronous
                      run's own timings (there, waiting = generating)
  sync_ratio          trainer-blocked time to push the model into a real vLLM engine (sync.push:
                      a broadcast per tensor into the worker's staging copy, then its load, as in
                      training) / one raw broadcast of the same bytes to the same worker on the
                      same group
  rollout_pause_share time the engine spends loading weights / time it spends generating
  rollout_efficiency  vLLM tokens/s inside the training loop (over the time it generates or loads)
                      / standalone vLLM generating the same prompts with the same sampling
                      settings, (eta + 1) * batch_groups groups at once: the most that admission
                      control lets the rollout process have in flight
  trainer_idle_share  share of the asynchronous trainer's wall-clock spent waiting for data
The first `warmup` steps (engine start, first batch) are left out of every average.
"""
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.abspath(__file__))
# lr=0: the weights still go through AdamW and on to vLLM every step, but the policy stays put, so
# the synchronous and the asynchronous run generate answers of the same lengths and do the same work
# per sample (learning would shorten the answers at a different pace in each run, and per-sample
# times would compare different work)
# name: (config, overrides, the `prepare.py` target that makes its model)
# borrow_cpus=False: each side keeps its own core, so the overlap is measured against a fixed split
# of the machine
CONFIGS = {"tiny": ("config/tiny.py", ["--max_steps=12", "--rollout_cpus=1",
                                       "--lr=0.0", "--borrow_cpus=False"], "tiny"),
           # 4 groups with reward spread per step, the eval on 100 sums: what the README's table
           # measured
           "smollm": ("config/smollm_cpu.py",
                      ["--max_steps=4", "--batch_groups=4", "--drop_flat=True", "--eval_n=100",
                       "--lr=0.0", "--borrow_cpus=False"], "smollm2"),
           # the agent demo: multi-turn answers with a calculator, whose tails are longest (all
           # groups trained: at lr=0 most would be flat, and waiting for others is not overlap)
           "calc": ("config/smollm_calc.py", ["--max_steps=5", "--batch_groups=4", "--lr=0.0",
                                              "--drop_flat=False", "--borrow_cpus=False"],
                    "smollm2")}
args = dict(a[2:].split("=", 1) for a in sys.argv[1:] if "=" in a)
warmup = int(args.get("warmup", 2))


def run_dir(name, overrides):
    return os.path.join(ROOT, "out/bench",
                        name + "".join(o.replace("--", "_").replace("=", "") for o in overrides))


def run(config, out, args, **kw):  # one rank of train.py into `out` -> (its step rows, process)
    os.makedirs(out, exist_ok=True)
    open(os.path.join(out, "metrics.jsonl"), "w").close()
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1",
                        "train.py", config, f"--out_dir={out}", *args], cwd=ROOT, **kw)
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    return [r for r in rows if "loss" in r], p


def train(name, *overrides):
    config, base, _ = CONFIGS[name]
    return run(config, run_dir(name, overrides), [*base, "--eval_every=0", *overrides],
               check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)[0]


def per_sample(rows):
    a, b = rows[warmup - 1], rows[-1]
    return (b["elapsed_s"] - a["elapsed_s"]) / (b["samples"] - a["samples"])


def mean(xs):
    return sum(xs) / len(xs)


def standalone_rollout(name, n_prompts):
    """vLLM alone on the same prompts, settings and concurrency as the rollout process: tokens/s."""
    code = f"""
import os, sys, time, json
sys.path.insert(0, {ROOT!r})
import rollout, reward
if __name__ == "__main__":
    from vllm import SamplingParams
    cfg = json.load(open(sys.argv[1]))
    llm = rollout.make_llm(cfg, "cpu", e=1)  # rollout_seqs, without engine 0's room for evals
    tok = llm.get_tokenizer()
    train_set = reward.load_task(cfg)["train"]
    prompts = [{{"prompt_token_ids": rollout.format_prompt(tok, p["prompt"])}}
               for p in train_set[:{n_prompts}]]
    params = SamplingParams(n=cfg["group_size"], temperature=cfg["temperature"],
                            max_tokens=cfg["max_new_tokens"], logprobs=0)
    llm.generate(prompts[:4], params, use_tqdm=False)  # warm-up
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    print(json.dumps({{"tokens_per_s": sum(len(c.token_ids) for o in outs for c in o.outputs)
                                       / (time.perf_counter() - t)}}))
"""
    config, base, _ = CONFIGS[name]
    cfg = json.load(open(os.path.join(ROOT, "out/bench", name + "_max_staleness0",
                                      "train_config.json")))
    path = os.path.join(ROOT, "out/bench", name + "_standalone.json")
    json.dump(cfg, open(path, "w"))
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_LOGGING_LEVEL="ERROR")
    cpus = cfg["rollout_cpus"]
    if cpus:  # the same cores the rollout process had
        env.update(VLLM_CPU_OMP_THREADS_BIND=cpus, OMP_NUM_THREADS=str(len(cpus.split(","))))
    prefix = ["taskset", "-c", cpus] if cpus else []
    out = subprocess.run(prefix + [sys.executable, "-c", code, path], env=env, capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["tokens_per_s"]


def weight_sync(model_dir, repeats=5):
    """Trainer-side seconds to push a model's weights into a real vLLM engine (sync.push: a
    broadcast per tensor into the worker's staging copy, then sync.load) vs one raw broadcast of
    the same bytes to the same worker."""
    code = f"""
import os, sys, torch
sys.path.insert(0, {ROOT!r})
import rollout, sync
def raw(worker, numel):
    worker.nanoasync["groups"][1].broadcast(torch.empty(numel), 0).wait()
if __name__ == "__main__":
    port, cfg = int(sys.argv[1]), dict(
        model={model_dir!r}, rollout_dtype="float32", colocate=False, timeout_s=60, seed=0,
        max_model_len=128, enforce_eager=True, gpu_memory_utilization=0.5, tensor_parallel_size=1,
        kv_cache_gb=1, rollout_seqs=4, group_size=4, eval_n=0, rollout_port=int(sys.argv[1]))
    llm = rollout.make_llm(cfg, "cpu")
    store = sync.open_store("127.0.0.1", port, False, 60)
    llm.collective_rpc(sync.join, args=(dict(cfg, host="127.0.0.1", engines=1), 1))
    for i in range({repeats}):
        store.wait([f"push{{i}}"]); llm.collective_rpc(sync.load)
        store.wait([f"raw{{i}}"]); llm.collective_rpc(raw, args=(int(store.get("numel")),))
"""
    import socket
    import torch
    from transformers import AutoModelForCausalLM
    import sync
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = sync.open_store("127.0.0.1", port, True, 60)
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_LOGGING_LEVEL="ERROR")
    peer = subprocess.Popen([sys.executable, "-c", code, str(port)], env=env)
    meta = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    sender = sync.Sender(store, sync.plan(meta),
                         {"rollout_dtype": "float32", "colocate": False, "timeout_s": 60,
                          "rollout_port": port},
                         torch.device("cpu"), 1)
    flat = torch.zeros(sum(n for *_, n in sender.plan))
    store.set("numel", str(flat.numel()))
    pushed, raw = [], []
    with torch.no_grad():
        for i in range(repeats):
            t = time.perf_counter()
            store.set(f"push{i}", "1")
            sync.push(sender, model.named_parameters(), sender.plan)
            pushed.append(time.perf_counter() - t)
            t = time.perf_counter()
            store.set(f"raw{i}", "1")
            sender.pg.broadcast(flat, 0).wait()
            raw.append(time.perf_counter() - t)
    peer.wait(timeout=60)
    return sorted(pushed)[repeats // 2], sorted(raw)[repeats // 2], flat.numel() * 4


def unshared_logprobs(model, group, device):
    """The plain alternative to loss.token_logprobs, for --shared=0: every completion runs with its
    own copy of the prompt, in chunks of similar length (loss.plan_chunks). -> logp, mask, (c, r)"""
    import torch
    import loss as L
    P, comps = len(group["prompt_ids"]), [c["ids"] for c in group["completions"]]
    T = max(map(len, comps))
    logp, mask = (torch.zeros(len(comps), T, device=device),
                  torch.zeros(len(comps), T, device=device))
    computed = real = 0
    for rows in L.plan_chunks([P + len(c) for c in comps]):
        W = P + len(comps[rows[0]])
        ids, am = L.padded([group["prompt_ids"] + comps[i] for i in rows], device, width=W + 1)
        am = am[:, :W]
        with L.scoring(model, ids[:, 1:, None], 1.0):  # the logprob of each next token
            lp = model(input_ids=ids[:, :W], attention_mask=am).logits[..., 0]
        idx = torch.tensor(rows, device=device)
        Tc = W - P
        logp = logp.index_put((idx,), torch.nn.functional.pad(lp[:, P - 1:W - 1], (0, T - Tc)))
        mask = mask.index_put((idx,), torch.nn.functional.pad(am[:, P:].float(), (0, T - Tc)))
        computed, real = computed + am.numel(), real + int(am.sum())
    return logp * mask, mask, (computed, real)


ENGINE_STANDALONE = """
import json, os, random, sys, time
sys.path.insert(0, {root!r})
import rollout, reward
if __name__ == "__main__":
    from vllm import SamplingParams
    cfg, G, steps = json.load(open(sys.argv[1])), int(sys.argv[2]), sys.argv[3].split(",")
    import torch
    llm = rollout.make_llm(cfg, "cuda" if torch.cuda.is_available() else "cpu")  # the loop's
    tok, train_set = llm.get_tokenizer(), reward.load_task(cfg)["train"]
    # the loop's prompt stream (rollout.Rollout.admit): the batches of the steps it was timed on
    perm = random.Random(f"{{cfg['seed']}}/0").sample(range(len(train_set)), len(train_set))
    batches = [[{{"prompt_token_ids": rollout.format_prompt(tok, train_set[perm[k]]["prompt"])}}
                for k in range(int(s) * G, (int(s) + 1) * G)] for s in steps]
    out = {{}}
    for name, extra in (("defaults", {{}}), ("loop_outputs", dict(detokenize=False,
                                                                  flat_logprobs=True))):
        if name == "loop_outputs" and os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1":
            continue
        params = SamplingParams(n=cfg["group_size"], temperature=cfg["temperature"], logprobs=0,
                                max_tokens=cfg["max_new_tokens"], **extra)
        llm.generate(batches[0][:4], params, use_tqdm=False)  # warm-up
        t, n = time.perf_counter(), 0
        for batch in batches:
            outs = llm.generate(batch, params, use_tqdm=False)
            n += sum(len(c.token_ids) for o in outs for c in o.outputs)
        out[name] = n / (time.perf_counter() - t)
    print(json.dumps(out))
"""
SMI = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"]


def count_gpus():
    try:
        return len(subprocess.run(SMI, capture_output=True, text=True).stdout.split())
    except FileNotFoundError:
        return 0


GPUS = count_gpus()
# the loop as the trainer sees it: synchronous (the trainer waits for every whole batch), lr=0 (the
# same answers every run), graded by the default 2 grader processes; vLLM alone on core 1 (the
# trainer on core 0), or on a GPU with CUDA graphs as the GPU recipes run: GPU 1, or the trainer's
# GPU shared (colocate) on a one-GPU machine
ENGINE_RUN = ["--max_staleness=0", "--lr=0.0", "--eval_every=0", "--drop_flat=False",
              "--group_size=8", "--max_new_tokens=64", "--borrow_cpus=False", "--temperature=1.0",
              *(["--rollout_cpus=", "--enforce_eager=False"] if GPUS else ["--rollout_cpus=1"]),
              *(["--colocate=True", "--gpu_memory_utilization=0.3"] if GPUS == 1 else [])]
ENGINE_SHAPE = {"tiny": (32, 8), "smollm": (16, 4)}  # groups of 8 in flight, steps


def engine_standalone(cfg_path, G, steps, multiprocess):
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING=str(int(multiprocess)),
               VLLM_LOGGING_LEVEL="ERROR")
    if GPUS:  # the loop's engine's GPU
        env.update(CUDA_VISIBLE_DEVICES="0" if GPUS == 1 else "1")
    else:  # the loop's engine's core
        env.update(VLLM_CPU_OMP_THREADS_BIND="1", OMP_NUM_THREADS="1")
    code = ENGINE_STANDALONE.format(root=ROOT)
    pin = [] if GPUS else ["taskset", "-c", "1"]
    try:
        out = subprocess.run([*pin, sys.executable, "-c", code, cfg_path, str(G),
                              ",".join(map(str, steps))], env=env, capture_output=True, text=True,
                             timeout=900)
    except subprocess.TimeoutExpired as e:
        sys.exit(f"standalone vLLM did not finish in 900 s:\n{(e.stderr or '')[-3000:]}")
    if out.returncode:
        sys.exit(f"standalone vLLM failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def profile(name, G, seconds=20):
    """py-spy on the rollout process of a loop run: the share of its main thread's wall-clock in
    each of Rollout's methods (waiting included), vLLM's own step split out of ours."""
    import shutil
    import psutil
    if not shutil.which("py-spy", path=os.path.dirname(sys.executable) + os.pathsep
                        + os.environ["PATH"]):
        return {"skipped": "pip install py-spy"}
    out = os.path.join(ROOT, "out/bench", name + "_profile")
    os.makedirs(out, exist_ok=True)
    config, base, _ = CONFIGS[name]
    run = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1",
                            "train.py", config, *base, *ENGINE_RUN, f"--batch_groups={G}",
                            f"--rollout_seqs={G * 8}", "--max_steps=1000", f"--out_dir={out}"],
                           cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while not (os.path.exists(f"{out}/metrics.jsonl") and open(f"{out}/metrics.jsonl").read()):
            if run.poll() is not None:
                sys.exit(f"the profiled run failed: see {out}")
            time.sleep(0.5)  # the engine is up and one batch went through
        pid = next(p.pid for p in psutil.Process(run.pid).children(recursive=True)
                   if "rollout.py" in " ".join(p.cmdline()))
        subprocess.run([os.path.join(os.path.dirname(sys.executable), "py-spy"), "record",
                        "--pid", str(pid), "--duration", str(seconds), "--idle", "--format", "raw",
                        "-o", f"{out}/raw.txt"], check=True, capture_output=True)
    finally:
        for p in [*psutil.Process(run.pid).children(recursive=True), run]:
            p.kill()
        run.wait()
    phases, total = {}, 0
    for line in open(f"{out}/raw.txt"):  # "frame;frame;... count", a frame "Class.method (file)"
        stack, count = line.rsplit(" ", 1)
        names = [f.split(" ")[0] for f in stack.split(";")]
        if "Rollout.run" not in names:
            continue  # not the loop's thread
        phase = (names + ["Rollout.run"])[names.index("Rollout.run") + 1]
        if phase == "Rollout.step":  # vLLM's LLMEngine.step: its engine core, its output processor
            below = (names + ["?"] * 4)[names.index("LLMEngine.step") + 1:] \
                if "LLMEngine.step" in names else None
            phase = "step: ours" if below is None else "step: vLLM " + (
                below[2].split(".")[-1] if below[0] == "InprocClient.get_output" else "outputs")
        phases[phase] = phases.get(phase, 0) + int(count)
        total += int(count)
    return {k: round(v / total, 3) for k, v in sorted(phases.items(), key=lambda kv: -kv[1])}


def engine_bench():
    """The loop's generation phase as the trainer waits for it (generated tokens / t_wait_s, at
    eta=0, so it waits for every whole batch), and inside vLLM's step (rollout_tokens /
    rollout_engine_s), against LLM.generate alone on the same prompts (the batches of the same
    steps), sampling, concurrency, engine settings and core (on a GPU: its GPU, CUDA graphs on,
    shared with the trainer on a one-GPU machine): in-process at vLLM's defaults, in-process with
    the loop's own output settings (no detokenizing, flat logprobs), and vLLM's default engine core
    in a process of its own. Then a py-spy profile of the loop."""
    runs, results = int(args.get("runs", 1)), {}
    for name in args.get("configs", "tiny,smollm").split(","):
        subprocess.run([sys.executable, "prepare.py", CONFIGS[name][2]], cwd=ROOT, check=True,
                       stdout=subprocess.DEVNULL)
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
            steps = range(warmup, S)
            inproc = engine_standalone(cfg_path, G, steps, False)
            r["generate_in_process"].append(inproc["defaults"])
            r["generate_loop_outputs"].append(inproc["loop_outputs"])
            r["generate_engine_process"].append(
                engine_standalone(cfg_path, G, steps, True)["defaults"])
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


def trainer_only():
    """The trainer step alone at the GPU recipe's shape, nothing downloaded: a Qwen2.5-1.5B-shaped
    model with random weights (on CPU a small model of the same vocabulary), wrapped as train.py
    wraps it (loss.shard), groups of 16 completions of mixed lengths up to `tokens` sharing one
    prompt, one group per micro-batch (loss.token_logprobs). Prints tokens/s, MFU (6 N tokens /
    time / peak), peak memory, pad_frac. --checkpointing=1: whole-layer activation checkpointing.
    --no_sync=1: accumulate the gradients unsharded across micro-batches, reduce-scattered once
    (FSDP's no-sync), to compare. --shared=0: no prompt KV sharing, every completion with its own
    prompt (unshared_logprobs)."""
    import torch
    import torch.distributed as dist
    from transformers import Qwen2Config, Qwen2ForCausalLM
    import loss as L
    gpu = torch.cuda.is_available()
    dist.init_process_group("nccl" if gpu else "gloo")
    device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if gpu else "cpu")
    if gpu:
        torch.cuda.set_device(device)
    big = args.get("shape", "1.5b" if gpu else "small") == "1.5b"
    cfg = Qwen2Config(vocab_size=151936, hidden_size=1536 if big else 256,
                      intermediate_size=8960 if big else 768, num_hidden_layers=28 if big else 2,
                      num_attention_heads=12 if big else 4, num_key_value_heads=2,
                      tie_word_embeddings=True)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    L.shard(model, torch.bfloat16 if gpu else torch.float32, args.get("checkpointing") == "1")
    no_sync, shared = args.get("no_sync") == "1", args.get("shared", "1") == "1"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    G, n, P = int(args.get("groups", 8 if gpu else 2)), 16, 256 if gpu else 64
    T = int(args.get("tokens", 1024 if gpu else 128))
    gen = torch.Generator().manual_seed(0)
    rand = lambda k: torch.randint(0, 150000, (k,), generator=gen).tolist()
    lengths = lambda: torch.randint(T // 8, T + 1, (n,), generator=gen).tolist()  # mixed, up to T
    groups = [{"prompt_ids": rand(P),
               "completions": [{"ids": rand(k), "mask": [1] * k} for k in lengths()]}
              for _ in range(G)]
    tokens = sum(len(g["prompt_ids"]) + sum(len(c["ids"]) for c in g["completions"])
                 for g in groups)
    times, computed, real = [], 0, 0
    for it in range(3):
        if gpu:
            torch.cuda.synchronize()
        t = time.perf_counter()
        for i, g in enumerate(groups):  # micro-batch = one group
            model.set_requires_gradient_sync(not no_sync or i == len(groups) - 1)
            logp, mask, (c, r) = L.token_logprobs(model, [g], 1.0, device) if shared else \
                unshared_logprobs(model, g, device)
            adv = torch.randn(n, device=device)
            loss, _ = L.grpo_loss(logp, logp.detach(), adv, mask, float(mask.sum()))
            loss.backward()
            computed, real = computed + c, real + r
        opt.step()
        opt.zero_grad()
        if gpu:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    step = min(times[1:])
    peak = 989e12 if gpu else None  # H100 SXM dense bf16
    out = {"device": torch.cuda.get_device_name() if gpu else "cpu", "params": n_params,
           "checkpointing": args.get("checkpointing") == "1", "no_sync": no_sync, "shared": shared,
           "step_s": step,
           "tokens": tokens, "tokens_per_s": tokens / step,
           # attention scores left out
           "mfu": 6 * n_params * tokens / step / peak if peak else None,
           "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if gpu else None,
           "peak_rss_gib": __import__("resource").getrusage(0).ru_maxrss / 2**20,
           "pad_frac": 1 - real / computed}
    if int(os.environ.get("RANK", 0)) == 0:
        print(json.dumps(out))
    dist.destroy_process_group()


TRL_BASELINE = """import json, sys, time
sys.path.insert(0, {root!r})
import torch, datasets, reward
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer
train_set, _ = reward.arithmetic(1337, 200)
ds = datasets.Dataset.from_list([{{"prompt": [{{"role": "user", "content": p["prompt"]}}],
                                  "answer": p["answer"]}} for p in train_set])
grade = lambda completions, answer, **kw: [reward.grade_number(c[0]["content"], a)
                                           for c, a in zip(completions, answer)]
times = []
class Clock(TrainerCallback):
    def on_step_end(self, *a, **kw):
        times.append(time.perf_counter())
cfg = GRPOConfig(output_dir="{out}", per_device_train_batch_size=16, gradient_accumulation_steps=8,
                 num_generations=8, max_completion_length=64, temperature=0.7, learning_rate=2e-5,
                 beta=0.0, max_steps={steps}, logging_steps=1, report_to="none", use_cpu=True,
                 bf16=False, save_strategy="no", seed=1337, lr_scheduler_type="constant")
trainer = GRPOTrainer(model="{model}", reward_funcs=grade, args=cfg, train_dataset=ds,
                      callbacks=[Clock()])
t0 = time.perf_counter()
trainer.train()
steps = [b - a for a, b in zip([t0] + times, times)]
logs = [h for h in trainer.state.log_history if "reward" in h]
print(json.dumps({{"trl_step_s": steps, "rewards": [h["reward"] for h in logs],
                  "lengths": [h["completions/mean_length"] for h in logs]}}))
"""


def trl_baseline():
    """The same-machine baseline: TRL's GRPOTrainer (needs `pip install trl datasets`) on the demo's
    task and model, 16 prompts x 8 samples of at most 64 tokens per step, fp32, lr 2e-5, against
    ours at the same batch (--batch_groups=16 --drop_flat=False, the demo's other settings).
    Samples/s and generated tokens/s over the steps after the first."""
    steps = int(args.get("steps", 4))
    subprocess.run([sys.executable, "prepare.py", "smollm2"], cwd=ROOT, check=True,
                   stdout=subprocess.DEVNULL)
    code = TRL_BASELINE.format(root=ROOT, out=os.path.join(ROOT, "out/bench/trl"), steps=steps,
                               model=os.path.join(ROOT, "data/smollm2-135m"))
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"TRL failed (pip install trl datasets?):\n{out.stderr[-2000:]}")
    trl = json.loads(out.stdout.strip().splitlines()[-1])
    ours = train("smollm", f"--max_steps={steps}", "--batch_groups=16", "--drop_flat=False",
                 "--lr=2e-5", "--borrow_cpus=True", "--eval_n=100")
    ours_step_s = [r["t_wait_s"] + r["t_train_s"] + r["t_sync_s"] for r in ours]
    ours_len = [r["response_len_mean"] for r in ours]
    # the answers shorten as the policy learns, at another pace in each: compare tokens/s too
    rate = lambda lens, secs: 128 * sum(lens[1:]) / sum(secs[1:])  # after the first step
    trl_s, ours_s = mean(trl["trl_step_s"][1:]), mean(ours_step_s[1:])
    trl_tok, ours_tok = rate(trl["lengths"], trl["trl_step_s"]), rate(ours_len, ours_step_s)
    print(json.dumps({"trl_step_s": trl["trl_step_s"], "trl_reward": trl["rewards"],
                      "trl_len": trl["lengths"], "ours_step_s": ours_step_s,
                      "ours_reward": [r["reward_mean"] for r in ours], "ours_len": ours_len,
                      "trl_samples_per_s": 128 / trl_s, "ours_samples_per_s": 128 / ours_s,
                      "speedup": trl_s / ours_s, "trl_tokens_per_s": trl_tok,
                      "ours_tokens_per_s": ours_tok, "speedup_tokens": ours_tok / trl_tok}))


SLOW_GRADER = """import functools, time, reward
slow = reward.grade_number
reward.grade_number = functools.wraps(slow)(
    lambda text, answer: time.sleep(0.05) or slow(text, answer))
"""


# the GPU recipe's answer rate, an estimate (not measured): an H100 engine making ~30k tokens/s
# of Qwen2.5-1.5B at 1024 sequences, GSM8K answers ~300 tokens: ~100 answers/s per engine
RECIPE_ANSWERS_PER_S = 30_000 / 300


def grading():
    """Workers: math-verify answers/s on GSM8K-style answers (a few sentences of working, then a
    boxed number) with 1 and 2 processes, collected by a loop that stands in for the engine's (a
    2 ms step, then Workers.wait and poll), against the GPU recipe's answer rate; then the tiny run
    with a 50 ms grader (a sitecustomize module slows it in every process): the loop's tokens/s
    while stepping or grading, and the share of that time spent on grades."""
    import tempfile
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
        while graders.busy:
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
    hook = tempfile.mkdtemp()
    open(os.path.join(hook, "sitecustomize.py"), "w").write(SLOW_GRADER)
    os.environ["PYTHONPATH"] = hook + os.pathsep + ROOT
    m = train("tiny", "--max_steps=6")[-1]
    busy = m["rollout_engine_s"] + m["rollout_grade_s"]
    out["slow_grader_tokens_per_s"] = m["rollout_tokens"] / busy
    out["slow_grader_grade_share"] = m["rollout_grade_s"] / busy
    del os.environ["PYTHONPATH"]
    print(json.dumps(out))


def gpu_check():
    """One command for a machine with GPUs: the tiny model and SmolLM2 (when data/smollm2-135m is
    there: `python prepare.py smollm2`) in fp32 and bf16, 6 steps at eta = 1 (so loads land during
    generation), colocated on GPU 0, then with the engine on GPU 1 (the NCCL weight broadcast)
    where there are >= 2 GPUs. Per run: whether it ran, logprob_mismatch (largest over steps: on
    completions the trained weights computed entirely), generation tokens/s in the loop, seconds
    per push, peak memory per GPU (nvidia-smi, every 0.5 s). No GPU: the tiny model on CPU,
    colocated through /dev/shm and separate over gloo, to check this command itself."""
    import threading
    n_gpus, smi = GPUS, SMI
    smollm = n_gpus and os.path.isdir(f"{ROOT}/data/smollm2-135m")
    models = {"tiny": "config/tiny.py", **({"smollm": "config/smollm_cpu.py"} if smollm else {})}
    modes = ["colocate"] + (["separate"] if n_gpus != 1 else [])
    subprocess.run([sys.executable, "prepare.py", "tiny"], cwd=ROOT, check=True,
                   stdout=subprocess.DEVNULL)
    rows = []
    for name, config in models.items():
        for dtype in ("float32", "bfloat16"):
            for mode in modes:
                over = [f"--rollout_dtype={dtype}", f"--trainer_dtype={dtype}", "--max_steps=6",
                        "--max_staleness=1", "--rollout_cpus=", "--eval_every=0",
                        f"--colocate={mode == 'colocate'}", "--gpu_memory_utilization=0.3"]
                out = run_dir(f"gpu_{name}_{dtype}_{mode}", [])
                peak, done = [0] * n_gpus, threading.Event()

                def watch():  # peak memory per GPU, every process on it
                    while not done.wait(0.5):
                        used = subprocess.run(smi, capture_output=True, text=True).stdout.split()
                        peak[:] = [max(a, int(b)) for a, b in zip(peak, used)]
                if n_gpus:
                    threading.Thread(target=watch, daemon=True).start()
                t0 = time.perf_counter()
                steps, p = run(config, out, over, capture_output=True, text=True)
                done.set()
                row = {"model": name, "dtype": dtype, "mode": mode, "rc": p.returncode,
                       "wall_s": round(time.perf_counter() - t0, 1), "steps": len(steps)}
                if steps:
                    last, whole = steps[-1], [r["logprob_mismatch"] for r in steps
                                              if r["logprob_mismatch"] is not None]
                    row.update(logprob_mismatch=max(whole, default=None),
                               shift_reloaded=max(r["logprob_shift_reloaded"] or 0 for r in steps),
                               gen_tokens_per_s=round(last["rollout_tokens"]
                                                      / last["rollout_engine_s"]),
                               push_s=round(mean([r["t_sync_s"] for r in steps[1:] or steps]), 3),
                               peak_mb=[round(x) for x in peak])
                open(os.path.join(out, "stderr.txt"), "w").write(p.stderr)
                if p.returncode:  # the first line that says what went wrong, and where it all is
                    said = [x for x in p.stderr.splitlines() if "rror" in x] or ["?"]
                    row["error"] = f"{said[0][:300]} (all of it: {out}/stderr.txt)"
                print(json.dumps(row), flush=True)
                rows.append(row)
    print("\nmodel   dtype     mode      rc  steps  mismatch  reloaded  gen tok/s  push s  peak MB"
          " (per GPU)")
    for r in rows:
        print(f"{r['model']:7s} {r['dtype']:9s} {r['mode']:9s} {r['rc']:3d} {r['steps']:5d}  "
              f"{r.get('logprob_mismatch') or 0:8.1e}  {r.get('shift_reloaded') or 0:8.1e}  "
              f"{r.get('gen_tokens_per_s', 0):9d}  {r.get('push_s', 0):6.3f}  {r.get('peak_mb')}")
    return int(any(r["rc"] for r in rows))


COPY_ALONE = """
import json, sys, time, torch
sys.path.insert(0, {root!r})
import rollout, sync
if __name__ == "__main__":
    from transformers import AutoModelForCausalLM
    cfg = json.load(open(sys.argv[1]))
    llm = rollout.make_llm(cfg, "cpu")
    dtype = getattr(torch, cfg["rollout_dtype"])
    model = AutoModelForCausalLM.from_pretrained(cfg["model"], dtype=dtype)
    state = [(n, p.detach()) for n, p in model.named_parameters()]
    def copy(worker):
        t = time.perf_counter()
        sync.copy_in(worker, iter(state))
        return time.perf_counter() - t
    times = sorted(llm.collective_rpc(copy)[0] for _ in range(5))
    print(json.dumps({{"copy_s": times[2]}}))
"""


def two_nodes(name, overrides):  # two torchrun agents on this machine, one rank each -> step rows
    config, base, _ = CONFIGS[name]
    out, port = run_dir(name + "_two_nodes", overrides), 29400 + os.getpid() % 500
    os.makedirs(out, exist_ok=True)
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
                               "--nproc_per_node=1", "--master_addr=127.0.0.1",
                               f"--master_port={port}", f"--node_rank={n}", "train.py", config,
                               *base, "--eval_every=0", f"--out_dir={out}", *overrides],
                              cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for n in (0, 1)]
    assert [p.wait() for p in nodes] == [0, 0], f"a node failed: see {out}"
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    return [r for r in rows if "loss" in r]


def fill_bench():
    """Every engine full, the three engine-side goals (--parts=occupancy,balance,pause):
      occupancy  rollout_running_frac per step (per engine step: training sequences in vLLM /
                 rollout_seqs) with long-tailed answers: SmolLM2, T = 1, 192 new tokens, 64 slots,
                 a budget (eta = 8) that never runs out in 6 steps, lr = 0, every group trained
      balance    each engine's trained groups over 8 asynchronous steps (eta = 1) / a fair share:
                 two engines on one node, then two nodes (two torchrun agents here), tiny model
      pause      the seconds each load paused generation in the occupancy run (rollout_pause_s)
                 / the same copy into vLLM alone (sync.copy_in from tensors in memory, a
                 standalone engine of the run's config on the same core), median of 5"""
    parts, out = args.get("parts", "occupancy,balance,pause").split(","), {}
    if "occupancy" in parts or "pause" in parts:
        subprocess.run([sys.executable, "prepare.py", "smollm2"], cwd=ROOT, check=True)
        over = ["--temperature=1.0", "--max_new_tokens=192", "--max_model_len=320",
                "--rollout_seqs=64", "--batch_groups=4", "--max_staleness=8", "--drop_flat=False",
                f"--max_steps={args.get('steps', 6)}"]
        rows = train("smollm", *over)
        out["running_frac"] = [r["rollout_running_frac"] for r in rows]
        out["running_frac_steady"] = mean([x for x in out["running_frac"][warmup:] if x])
        out["response_len_mean"] = [round(r["response_len_mean"]) for r in rows]
        out["cut_frac"] = [r["cut_frac"] for r in rows]
        pauses = [r["rollout_pause_s"] for r in rows if r["rollout_pause_s"]]
        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_LOGGING_LEVEL="ERROR",
                   VLLM_CPU_OMP_THREADS_BIND="1", OMP_NUM_THREADS="1")
        cfg_path = os.path.join(run_dir("smollm", over), "train_config.json")
        p = subprocess.run(["taskset", "-c", "1", sys.executable, "-c",
                            COPY_ALONE.format(root=ROOT), cfg_path], env=env, cwd=ROOT,
                           capture_output=True, text=True, check=True)
        out["copy_s"] = json.loads(p.stdout.strip().splitlines()[-1])["copy_s"]
        out["pause_s"], out["pause_over_copy"] = pauses, mean(pauses) / out["copy_s"]
    if "balance" in parts:
        subprocess.run([sys.executable, "prepare.py", "tiny"], cwd=ROOT, check=True)
        over = ["--max_steps=8", "--max_staleness=1"]
        for where, rows in (("one_node", train("tiny", "--rollout_engines=2", *over)),
                            ("two_nodes", two_nodes("tiny", over))):
            per = [sum(r["engine_groups"][e] for r in rows) for e in (0, 1)]
            out[f"balance_{where}"] = {"per_step": [r["engine_groups"] for r in rows],
                                       "share_of_fair": [x / (sum(per) / 2) for x in per]}
    for k, v in out.items():
        print(f"  {k:22s} {v}")
    print(json.dumps(out))


def plot(run_dir, baseline=None):
    """{run_dir}/curves.png: reward and eval accuracy by samples and time; the trainer's time.
    A task with a tool adds its calls per answer; baseline: a held-out accuracy to draw (the same
    model without the tool), or a run directory whose first eval gives it."""
    from matplotlib.figure import Figure
    rows = [json.loads(line) for line in open(f"{run_dir}/metrics.jsonl")]
    steps, evals = [r for r in rows if "loss" in r], [r for r in rows if "eval_accuracy" in r]
    if baseline and os.path.isdir(baseline):
        baseline = next(json.loads(line)["eval_accuracy"] for line in open(
            f"{baseline}/metrics.jsonl") if "eval_accuracy" in line)
    at = {r["version"]: r for r in steps}
    fig = Figure(figsize=(15, 4), layout="tight")
    ax = fig.subplots(1, 3)
    for a, x, label in zip(ax, ("samples", "elapsed_s"), ("trained samples", "wall-clock (s)")):
        a.plot([r[x] for r in steps], [r["reward_mean"] for r in steps], label="train reward")
        # an eval row has no sample count: take its version's step row's (0 before the first step)
        ex = [e.get(x, at.get(e["version"], {}).get(x, 0)) for e in evals]
        a.plot(ex, [e["eval_accuracy"] for e in evals], "o-", label="held-out accuracy (greedy)")
        if any(r.get("turns_mean", 1) > 1 for r in steps):
            a.plot([r[x] for r in steps], [r["turns_mean"] - 1 for r in steps], "--",
                   label="tool calls per answer")
        if baseline is not None:
            a.axhline(float(baseline), color="gray", linestyle=":", label="held-out, no tool")
        a.set(xlabel=label, ylim=(0, 1.05))
    keys = ("t_wait_s", "t_train_s", "t_sync_s")
    for i, key in enumerate(keys):  # stacked
        ax[2].bar([r["step"] for r in steps], [r[key] for r in steps], label=key[2:-2],
                  bottom=[sum(r[k] for k in keys[:i]) for r in steps])
    ax[2].set(xlabel="step", ylabel="trainer seconds")
    for a in ax:
        a.legend()
    fig.suptitle(run_dir)
    fig.savefig(f"{run_dir}/curves.png", dpi=80)
    return f"{run_dir}/curves.png"



if __name__ == "__main__":
    if "--plot" in sys.argv:
        sys.exit(print(plot([a for a in sys.argv[1:] if a[:2] != "--"][-1], args.get("baseline"))))
    if "--trainer" in sys.argv:
        sys.exit(trainer_only())
    if "--grading" in sys.argv:
        sys.exit(grading())
    if "--gpu" in sys.argv:
        sys.exit(gpu_check())
    if "--engine" in sys.argv:
        sys.exit(engine_bench())
    if "--trl" in sys.argv:
        sys.exit(trl_baseline())
    if "--fill" in sys.argv:
        sys.exit(fill_bench())
    results, table = {}, []
    for name in args.get("configs", "tiny,smollm").split(","):
        # the config's model, made offline once (a no-op when it is there already)
        subprocess.run([sys.executable, "prepare.py", CONFIGS[name][2]], cwd=ROOT, check=True,
                       stdout=subprocess.DEVNULL)
        sync_rows = train(name, "--max_staleness=0")
        async_rows = train(name)
        steady = async_rows[warmup:]
        t_gen = mean([r["t_wait_s"] for r in sync_rows[warmup:]])
        t_train = mean([r["t_train_s"] + r["t_sync_s"] for r in sync_rows[warmup:]])
        last = async_rows[-1]
        results[name] = {"overlap_speedup": per_sample(sync_rows) / per_sample(async_rows),
                         "overlap_bound": (t_gen + t_train) / max(t_gen, t_train),
                         "t_gen_s": t_gen, "t_train_s": t_train,
                         "turns_mean": mean([r["turns_mean"] for r in steady])}
        if "--overlap" in sys.argv:
            continue
        in_loop = last["rollout_tokens"] / (last["rollout_engine_s"] + last["rollout_load_s"])
        cfg = json.load(open(os.path.join(ROOT, "out/bench", name, "train_config.json")))
        in_flight = min(cfg["rollout_seqs"] // cfg["group_size"],
                        (cfg["max_staleness"] + 1) * cfg["batch_groups"])
        bucketed, raw, nbytes = weight_sync(
            json.load(open(os.path.join(ROOT, "out/bench", name + "_max_staleness0",
                                        "train_config.json")))["model"])
        r = {**results[name], "sync_ratio": bucketed / raw, "sync_s": bucketed, "sync_raw_s": raw,
             "weight_mb": nbytes / 2**20,
             "rollout_pause_share": last["rollout_load_s"] / last["rollout_engine_s"],
             "rollout_efficiency": in_loop / standalone_rollout(name, in_flight),
             "rollout_tokens_per_s": in_loop,
             "trainer_idle_share": (sum(r["t_wait_s"] for r in steady)
                                    / sum(r["t_wait_s"] + r["t_train_s"] + r["t_sync_s"]
                                          for r in steady)),
             "trainer_tokens_per_s": mean([r["train_tokens_per_s"] for r in steady])}
        results[name] = r
    for name, r in results.items():
        print(f"\n{name}")
        for k, v in r.items():
            print(f"  {k:22s} {v:.3f}" if isinstance(v, float) else f"  {k:22s} {v}")
    # top level: the last (largest) config
    print(json.dumps(results[name] | {"config": name, "per_config": results}))
