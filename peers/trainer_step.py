"""The trainer's step alone (`torchrun --nproc_per_node=N bench.py --trainer [--key=value]`, which
runs main() here), and the varlen kernel's check (`python bench.py --varlen`). No vLLM, nothing
downloaded: random weights in a model of a real shape.

Shapes (--shape): small (CPU: 2 layers of Qwen2.5's vocabulary), 1.5b (Qwen2.5-1.5B, tied), 7b
(Qwen2.5-7B, untied). --lora_rank=R: as train.py with LoRA (the base frozen in bf16 out of FSDP,
a fp32 adapter on every linear layer); --max_gib=G exits non-zero past G GiB of peak memory (GPU:
the allocator's peak; CPU: the process's RSS): config/qwen_lora.py's goal is
`--shape=7b --lora_rank=32 --checkpointing=1 --budget=16384 --max_gib=30`."""
import json
import os
import sys
import time

SHAPES = {
    "small": dict(vocab_size=151936, hidden_size=256, intermediate_size=768, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    "1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                 num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                 tie_word_embeddings=True),
    "7b": dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944,
               num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
               tie_word_embeddings=False)}
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# dense bf16 tensor-core peaks (FLOP/s, no sparsity), by what torch.cuda.get_device_name() holds
PEAKS = [("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12), ("H20", 148e12),
         ("A100", 312e12), ("B200", 2250e12), ("L40S", 362e12), ("A10", 125e12)]


def main(args):
    """The trainer step alone, no vLLM, nothing downloaded: a Qwen2.5-1.5B-shaped model with
    random weights (on CPU a small model of the same vocabulary; --shape=small|1.5b), wrapped as
    train.py wraps it (loss.shard), G groups of 16 completions of mixed lengths up to --tokens,
    each sharing its prompt, packed into micro-batches of --budget tokens and accumulated as
    train.py does. Prints the step's seconds, tokens/s, MFU (the model's FLOPs, attention's
    included, / time / the present GPU's bf16 peak), peak memory, and where the time goes:
    forward calls, decoder-layer calls (recomputes included; compiled, a layer's hook runs only
    as it is traced), host syncs (CUDA), tokens per forward, the padded share of the positions
    computed. On a GPU it first checks that the
    FlashAttention varlen path gives the logprobs and gradients of the per-segment SDPA path.
    --checkpointing=1: whole-layer activation checkpointing. --shared=0: no prompt sharing
    (each completion with its own copy of the prompt). --compile=0: no torch.compile of the
    decoder layers (train.py's compile_layers: on a GPU it is on; its compile time is in step
    0). --varlen=0: the GPU's attention as on CPU, an SDPA call a segment. --profile=1: one more
    step under torch.profiler (the GPU's busy share)."""
    import warnings
    import torch
    import torch.distributed as dist
    from transformers import Qwen2Config, Qwen2ForCausalLM
    import loss as L
    gpu = torch.cuda.is_available()
    dist.init_process_group("nccl" if gpu else "gloo")
    device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if gpu else "cpu")
    if gpu:
        torch.cuda.set_device(device)
    cfg = Qwen2Config(**SHAPES[args.get("shape", "1.5b" if gpu else "small")])
    dtype = torch.bfloat16 if gpu else torch.float32
    rank = int(args.get("lora_rank", 0))
    torch.manual_seed(0)
    with device:  # made where it runs (1.5B random weights on the host take a while); LoRA's
        model = Qwen2ForCausalLM(cfg).to(dtype if rank else torch.float32)  # base: as train.py
    if rank:  # as train.py: the base frozen in the compute dtype, a fp32 adapter
        import lora
        model = lora.add(model, {"lora_rank": rank, "lora_alpha": rank,
                                 "lora_targets": "all-linear"}, dtype)
    n_params = sum(p.numel() for p in model.parameters())
    head = cfg.vocab_size * cfg.hidden_size
    if gpu and not rank:
        varlen_check(device)
    L.VARLEN = args.get("varlen", "1") == "1"  # 0: an SDPA call a segment, to compare
    compiled = args.get("compile", "1") == "1" and L.varlen_runs(device, dtype)  # as loss.shard
    L.shard(model, dtype, args.get("checkpointing") == "1", compiled)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6,
                            fused=gpu)
    groups = random_groups(int(args.get("groups", 8 if gpu else 2)), 256 if gpu else 64,
                           int(args.get("tokens", 1024 if gpu else 128)))
    if args.get("shared", "1") == "0":  # each completion alone, with its own copy of the prompt
        groups = [dict(g, completions=[c]) for g in groups for c in g["completions"]]
    tokens = sum(len(g["prompt_ids"]) + sum(len(c["ids"]) for c in g["completions"])
                 for g in groups)
    calls = {"forward": 0, "layer": 0}
    model.register_forward_pre_hook(lambda *a: calls.update(forward=calls["forward"] + 1))
    for layer in model.model.layers:  # self_attn: a layer's recompute runs it again
        layer.self_attn.register_forward_pre_hook(lambda *a: calls.update(layer=calls["layer"] + 1))
    micro = L.micro_batches(groups, int(args.get("budget", 16384 if gpu else 4096)))
    times, syncs = [], 0
    for it in range(4):
        calls.update(forward=0, layer=0)
        if gpu:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn" if it == 3 else 0)  # the last: count syncs
        t = time.perf_counter()
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            positions = step(model, opt, micro, device)
        if gpu:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        syncs = sum("synchronizing" in str(w.message) for w in said)
    if gpu:
        torch.cuda.set_sync_debug_mode(0)
    step_s = min(times[1:3])
    flops = 6 * (n_params - head) * positions + 6 * head * tokens_scored(groups)
    if rank:  # a frozen weight needs no weight gradient: 4 FLOPs a parameter a token, not 6
        flops -= 2 * (n_params - head) * positions
    flops += 12 * cfg.num_hidden_layers * cfg.hidden_size * attention_pairs(groups)
    peak = next((p for name, p in PEAKS if gpu and name in torch.cuda.get_device_name()), None)
    out = {"device": torch.cuda.get_device_name() if gpu else "cpu", "params": n_params,
           "checkpointing": args.get("checkpointing") == "1", "shared": args.get("shared", "1"),
           "compile": compiled, "step_s": step_s, "step0_s": times[0],
           "tokens": tokens, "tokens_per_s": tokens / step_s,
           "mfu": flops / step_s / peak if peak else None, "tflops": flops / step_s / 1e12,
           "forward_calls": calls["forward"], "decoder_layer_calls": calls["layer"],
           "host_syncs": syncs if gpu else None, "micro_batches": len(micro),
           "tokens_per_forward": positions / len(micro), "pad_frac": 0.0,  # packed: none
           "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if gpu else None,
           "peak_rss_gib": __import__("resource").getrusage(0).ru_maxrss / 2**20,
           "lora_rank": rank, "shape": args.get("shape", "1.5b" if gpu else "small")}
    if int(os.environ.get("RANK", 0)) == 0:
        print(json.dumps(out), flush=True)
    limit = float(args.get("max_gib", 0))  # the recipe's memory goal, checked
    used = out["peak_mem_gib"] if gpu else out["peak_rss_gib"]
    if limit and used > limit:
        sys.exit(f"peak memory {used:.1f} GiB > --max_gib={limit:g}")
    if args.get("profile") == "1":  # one more step, kernels timed: how busy the GPU is
        profile_step(lambda: step(model, opt, micro, device), gpu)
    dist.destroy_process_group()


def profile_step(run, gpu):
    """One step under torch.profiler: its wall seconds, the seconds kernels ran (the GPU busy)
    and the kernels that took longest."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    with profile(activities=acts) as prof:
        t = time.perf_counter()
        run()
        if gpu:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t
    from torch.autograd import DeviceType
    events = prof.key_averages()  # a kernel's time shows in its row and in its CPU op's: once
    busy = sum(e.self_device_time_total for e in events if e.device_type != DeviceType.CPU) / 1e6
    print(events.table(sort_by="self_device_time_total" if gpu else "self_cpu_time_total",
                       row_limit=20, max_name_column_width=60))
    print(json.dumps({"profiled_step_s": wall, "kernel_s": busy, "gpu_busy": busy / wall}),
          flush=True)


def random_groups(G, prompt, longest, n=16, seed=0, vocab=150000):
    """G groups: a random prompt, then n completions of random lengths up to `longest`."""
    import torch
    gen = torch.Generator().manual_seed(seed)
    rand = lambda k: torch.randint(0, vocab, (k,), generator=gen).tolist()
    groups = []
    for _ in range(G):
        prompt_ids = rand(prompt)
        lengths = torch.randint(longest // 8, longest + 1, (n,), generator=gen).tolist()
        groups.append({"prompt_ids": prompt_ids, "completions": [
            {"ids": rand(k), "mask": [1] * k, "logprobs": [-1.0] * k, "versions": [0] * k,
             "reward": float(i % 2)} for i, k in enumerate(lengths)]})
    return groups


def step(model, opt, micro, device):  # one optimizer step over packed micro-batches -> positions
    import loss as L
    positions = 0
    n_tok = sum(len(c["ids"]) for b in micro for g in b for c in g["completions"])
    for i, groups in enumerate(micro):
        last = i == len(micro) - 1
        model.set_requires_gradient_sync(last)
        model.set_reshard_after_backward(last)
        batch = L.to_device(L.pack(groups), device)
        logp = L.token_logprobs(model, batch, 1.0)
        adv = L.group_advantages(batch["rewards"], len(groups[0]["completions"]))
        loss, _ = L.grpo_loss(logp, batch["behav"], adv, batch["mask"], n_tok)
        loss.backward()
        positions += len(batch["ids"])
    opt.step()
    opt.zero_grad(set_to_none=True)
    return positions


def tokens_scored(groups):  # the output layer runs on completion tokens only
    return sum(len(c["ids"]) for g in groups for c in g["completions"])


def attention_pairs(groups):  # (query, key) pairs the packed causal attention computes
    pairs = 0
    for g in groups:
        P = len(g["prompt_ids"])
        pairs += P * (P + 1) // 2
        for c in g["completions"]:
            n = len(c["ids"]) - 1
            pairs += n * P + n * (n + 1) // 2
    return pairs


def varlen_check(device=None):
    """GPU: two groups through FlashAttention's varlen kernel (bf16) and through the per-segment
    SDPA path in fp32 and in bf16, on two layers of the 1.5B shape (12 query heads on 2 KV heads
    of 128): the logprobs' and gradients' largest differences. A wrong causal alignment (a
    completion's queries belong at the end of its keys) or head grouping would show as O(1);
    bf16 against fp32 is rounding, ~1e-2."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    import loss as L
    if not torch.cuda.is_available():  # the kernel is CUDA's: nothing to compare here
        print(json.dumps({"varlen_check": "skipped: no GPU"}), flush=True)
        return 0
    device = device or torch.device("cuda")
    cfg = Qwen2Config(vocab_size=2000, hidden_size=1536, intermediate_size=1024,
                      num_hidden_layers=2, num_attention_heads=12, num_key_value_heads=2)
    groups = random_groups(2, 100, 200, n=4, seed=1, vocab=2000)
    batch = L.to_device(L.pack(groups), device)
    out = {}
    for name, dtype, varlen in (("varlen_bf16", torch.bfloat16, True),
                                ("sdpa_bf16", torch.bfloat16, False),
                                ("sdpa_fp32", torch.float32, False)):
        torch.manual_seed(0)
        m = Qwen2ForCausalLM(cfg).to(device, dtype)
        m.set_attn_implementation("nanoasync_packed")
        L.VARLEN = varlen
        logp = L.token_logprobs(m, batch, 1.0)
        logp.sum().backward()
        grad = torch.cat([p.grad.float().reshape(-1) for p in m.parameters()])
        out[name] = (logp.detach().float(), grad)
    L.VARLEN = True
    ref_lp, ref_g = out["sdpa_fp32"]
    report = {f"{k}_vs_sdpa_fp32": {"logp_max_diff": (lp - ref_lp).abs().max().item(),
                                    "grad_rel_diff": ((g - ref_g).norm() / ref_g.norm()).item()}
              for k, (lp, g) in out.items() if k != "sdpa_fp32"}
    print(json.dumps({"varlen_check": report}), flush=True)
    # varlen in bf16 must be as close to fp32 as SDPA in bf16 is (rounding); a misalignment is O(1)
    for what, limit in (("logp_max_diff", 0.1), ("grad_rel_diff", 0.05)):
        got, floor = (report[f"{k}_vs_sdpa_fp32"][what] for k in ("varlen_bf16", "sdpa_bf16"))
        assert got < max(limit, 3 * floor), f"varlen: {what} {got:.3g} (SDPA bf16: {floor:.3g})"
    return 0




if __name__ == "__main__":  # torchrun --nproc_per_node=1 peers/trainer_step.py [--key=value]
    sys.exit(main(dict(a[2:].split("=", 1) for a in sys.argv[1:] if "=" in a)))
