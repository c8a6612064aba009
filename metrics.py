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


def token_sums(loss, trunc, logp, behav, mask, fresh, positions):
    """One micro-batch's share of SUMS. fresh: tokens sampled by the weights being trained (staleness 0)."""
    import torch
    fresh = fresh & (mask > 0)
    stale = (mask > 0) & ~fresh
    shift = (logp.detach() - behav).abs()  # |log rho|
    return torch.stack([x.float().sum() for x in (
        loss.detach(), trunc & fresh, fresh, trunc & stale, stale, shift * fresh, shift * stale,
        *map(torch.tensor, positions))]).to(logp.device)


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


def reopen(path, start):
    """A fresh run, a fresh file; a resumed one keeps the lines that led up to its checkpoint."""
    kept = [line for line in open(path) if json.loads(line)["step"] < start] \
        if start and os.path.exists(path) else []
    f = open(path, "w")
    f.writelines(kept)
    return f


class Log:
    """Rank 0's outputs: metrics.jsonl, samples.jsonl (a few completions per step, to read what the model
    writes), and Weights & Biases when wandb_log is set."""

    def __init__(self, cfg, start, t_start):
        self.t_start, self.wandb = t_start, None
        self.metrics = reopen(os.path.join(cfg["out_dir"], "metrics.jsonl"), start)
        self.samples = reopen(os.path.join(cfg["out_dir"], "samples.jsonl"), start)
        if cfg["wandb_log"]:
            import wandb
            self.wandb = wandb.init(project=cfg["wandb_project"], name=cfg["wandb_run_name"] or None, config=cfg,
                                    dir=cfg["out_dir"])

    def step(self, m, groups, evals):
        print(console(m), flush=True)
        self.metrics.write(json.dumps(m) + "\n")
        for g in groups[:2]:
            for c in g["completions"][:2]:
                self.samples.write(json.dumps({"step": m["step"], "prompt": g["prompt"], "completion": c["text"],
                                               "reward": c["reward"], "versions": sorted(set(c["versions"]))}) + "\n")
        if self.wandb:
            self.wandb.log({k: v for k, v in m.items() if isinstance(v, (int, float))}, step=m["version"])
        self.evals(evals)

    def evals(self, evals):
        while evals:
            e = eval_row(evals.pop(0), self.t_start)
            self.metrics.write(json.dumps(e) + "\n")
            if self.wandb:
                self.wandb.log({"eval_accuracy": e["eval_accuracy"]}, step=e["version"])
        self.metrics.flush()
        self.samples.flush()

    def close(self):
        self.metrics.close()
        self.samples.close()
        if self.wandb:
            self.wandb.finish()


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
