"""
metrics.py: what train.py logs. One JSON object per optimizer step and per eval in {out_dir}/metrics.jsonl,
a console line per step, and curves.png at the end (`python metrics.py OUT_DIR` redraws it).

The health metrics worth watching: reward_mean and eval_accuracy (learning); logprob_mismatch (trainer vs
vLLM logprobs of fresh tokens, same weights: ~1e-6 in fp32, larger in bf16; a jump means the weight sync or
the sampled distribution is wrong); staleness_mean/max and trunc_frac_stale (how off-policy the batch is);
t_wait_s / t_train_s / t_sync_s (where the trainer's time goes).
"""
import json
import os
import sys

# the per-token sums every rank adds up over its micro-batches, all-reduced once per step
SUMS = ("loss", "trunc_fresh", "fresh", "trunc_stale", "stale", "shift_fresh", "shift_stale", "computed", "real")


def ratio(a, b):
    return a / b if b else None  # None: no such tokens in this step


def step_row(step, groups, seen, s, engines, **extra):
    """groups: the trained batch; seen: every group taken out of the buffer (flat and stale ones too);
    s: {name in SUMS: float}."""
    import buffer
    comps = [c for g in groups for c in g["completions"]]
    rewards = [c["reward"] for g in seen for c in g["completions"]]  # what the policy got, flat groups too
    stale = [step - min(c["versions"], default=step) for c in comps]
    return {"step": step, "version": step + 1, "reward_mean": sum(rewards) / len(rewards),
            "response_len_mean": sum(len(c["ids"]) for c in comps) / len(comps),
            "staleness_mean": sum(stale) / len(stale), "staleness_max": max(stale),
            "mixed_version_frac": sum(len(set(c["versions"])) > 1 for c in comps) / len(comps),
            "flat_frac": sum(map(buffer.is_flat, groups)) / len(groups),
            "engine_groups": [sum(g["engine"] == e for g in groups) for e in range(engines)],
            "loss": s["loss"], "logprob_mismatch": ratio(s["shift_fresh"], s["fresh"]),
            "logprob_shift_stale": ratio(s["shift_stale"], s["stale"]),
            "trunc_frac": ratio(s["trunc_fresh"] + s["trunc_stale"], s["fresh"] + s["stale"]),
            "trunc_frac_fresh": ratio(s["trunc_fresh"], s["fresh"]),
            "trunc_frac_stale": ratio(s["trunc_stale"], s["stale"]),
            "stale_token_frac": ratio(s["stale"], s["fresh"] + s["stale"]),
            "pad_frac": 1 - s["real"] / s["computed"],  # padded share of the positions the trainer computed
            "prompts": sorted(g["pos"] for g in groups), **extra}


def console(m):
    return (f"step {m['step']:4d} | reward {m['reward_mean']:.3f} | stale {m['staleness_mean']:.2f}/"
            f"{m['staleness_max']} | {m['train_tokens_per_s']:.0f} tok/s | wait {m['t_wait_s']:.2f}s "
            f"train {m['t_train_s']:.2f}s sync {m['t_sync_s']:.2f}s")


def eval_row(e, t_start):
    print(f"eval @ version {e['version']}: accuracy {e['eval_accuracy']:.3f} (n={e['eval_n']})", flush=True)
    return {"step": e["version"], "version": e["version"], "eval_accuracy": e["eval_accuracy"],
            "eval_n": e["eval_n"], "elapsed_s": e["t"] - t_start}


def open_log(out_dir, start):
    """A fresh run, a fresh log; a resumed one keeps what led up to its checkpoint."""
    path = os.path.join(out_dir, "metrics.jsonl")
    kept = [line for line in open(path) if json.loads(line)["step"] < start] \
        if start and os.path.exists(path) else []
    log = open(path, "w")
    log.writelines(kept)
    return log


def plot(run_dir):
    """{run_dir}/curves.png: reward and eval accuracy against samples and time, and the trainer's time."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    steps, evals = [r for r in rows if "loss" in r], [r for r in rows if "eval_accuracy" in r]
    per_version = {r["version"]: r for r in steps}
    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    for i, (x, label) in enumerate((("samples", "trained samples"), ("elapsed_s", "wall-clock (s)"))):
        ax[i].plot([r[x] for r in steps], [r["reward_mean"] for r in steps], label="train reward")
        ex = [per_version[e["version"]][x] if e["version"] in per_version else 0 for e in evals] \
            if x == "samples" else [e["elapsed_s"] for e in evals]
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


if __name__ == "__main__":
    print(plot(sys.argv[1]))
