"""metrics.py: metrics.jsonl (a row per step and per eval), console lines and curves.png
(`python metrics.py OUT_DIR` redraws it). README lists the keys worth watching; logprob_mismatch
(trainer vs vLLM logprobs of fresh tokens) is ~1e-6 in fp32: a jump means a bad weight sync."""
import json
import os
import sys

# per-token sums each rank adds up over its micro-batches, all-reduced once per step
SUMS = ("loss", "bounded_fresh", "fresh", "bounded_stale", "stale", "shift_fresh", "shift_stale",
        "computed", "real")


def token_sums(loss, bounded, logp, behav, mask, fresh, positions):
    """A micro-batch's share of SUMS; fresh: tokens sampled by the weights being trained."""
    import torch
    fresh, stale = fresh & (mask > 0), ~fresh & (mask > 0)
    shift = (logp.detach() - behav).abs()  # |log rho|
    parts = (loss.detach(), bounded & fresh, fresh, bounded & stale, stale, shift * fresh,
             shift * stale, *torch.tensor(positions, device=logp.device))
    return torch.stack([x.float().sum() for x in parts])


def mean(xs):
    return sum(xs) / len(xs)


def ratio(a, b):
    return a / b if b else None  # None: no such tokens this step


def step_row(step, groups, seen, s, engines, **extra):
    """groups: the trained batch; seen: all groups taken from the buffer; s: {SUMS name: float}."""
    import buffer
    comps = [c for g in groups for c in g["completions"]]
    stale = [step - min(c["versions"], default=step) for c in comps]
    return {
        "step": step, "version": step + 1,
        "reward_mean": mean([c["reward"] for g in seen for c in g["completions"]]),
        "response_len_mean": mean([len(c["ids"]) for c in comps]),
        "staleness_mean": mean(stale), "staleness_max": max(stale),
        "mixed_version_frac": mean([len(set(c["versions"])) > 1 for c in comps]),
        "flat_frac": mean([buffer.is_flat(g) for g in groups]),
        "engine_groups": [sum(g["engine"] == e for g in groups) for e in range(engines)],
        "loss": s["loss"], "logprob_mismatch": ratio(s["shift_fresh"], s["fresh"]),
        "logprob_shift_stale": ratio(s["shift_stale"], s["stale"]),
        "bounded_frac_fresh": ratio(s["bounded_fresh"], s["fresh"]),
        "bounded_frac_stale": ratio(s["bounded_stale"], s["stale"]),
        "cut_frac": mean([c["cut"] for c in comps]),  # cut at max_new_tokens
        "stale_token_frac": ratio(s["stale"], s["fresh"] + s["stale"]),
        "pad_frac": 1 - s["real"] / s["computed"],
        "prompts": sorted(g["pos"] for g in groups), **extra}


def console(m):
    return (f"step {m['step']:4d} | reward {m['reward_mean']:.3f} | stale "
            f"{m['staleness_mean']:.2f}/{m['staleness_max']} | {m['train_tokens_per_s']:.0f} tok/s"
            f" | wait {m['t_wait_s']:.2f}s train {m['t_train_s']:.2f}s sync {m['t_sync_s']:.2f}s")


def eval_row(e, t_start):
    print(f"eval @ version {e['version']}: accuracy {e['eval_accuracy']:.3f} (n={e['eval_n']})",
          flush=True)
    return {"step": e["version"], **{k: e[k] for k in ("version", "eval_accuracy", "eval_n")},
            "elapsed_s": e["t"] - t_start}


def reopen(path, start):
    """A resumed run keeps the lines before its checkpoint. Line-buffered: a crash loses nothing."""
    kept = open(path).readlines() if start and os.path.exists(path) else []
    f = open(path, "w", buffering=1)
    f.writelines(line for line in kept if json.loads(line)["step"] < start)
    return f


class Log:
    """Rank 0's metrics.jsonl, samples.jsonl (a few completions a step) and wandb (wandb_log)."""

    def __init__(self, cfg, start, t_start):
        self.t_start, self.wandb, out = t_start, None, cfg["out_dir"]
        self.metrics = reopen(f"{out}/metrics.jsonl", start)
        self.samples = reopen(f"{out}/samples.jsonl", start)
        if cfg["wandb_log"]:
            import wandb
            self.wandb = wandb.init(project=cfg["wandb_project"], config=cfg, dir=out,
                                    name=cfg["wandb_run_name"] or None)

    def write(self, row, keys):
        print(json.dumps(row), file=self.metrics)
        if self.wandb:
            self.wandb.log({k: row[k] for k in keys}, step=row["version"])

    def step(self, m, groups, evals):
        print(console(m), flush=True)
        self.write(m, [k for k, v in m.items() if isinstance(v, (int, float))])
        for g in groups[:2]:
            for c in g["completions"][:2]:
                print(json.dumps({"step": m["step"], "prompt": g["prompt"], "completion": c["text"],
                                  "reward": c["reward"], "versions": sorted(set(c["versions"]))}),
                      file=self.samples)
        self.evals(evals)

    def evals(self, evals):
        while evals:
            self.write(eval_row(evals.pop(0), self.t_start), ["eval_accuracy"])

    def close(self, evals):
        self.evals(evals)
        self.metrics.close()
        self.samples.close()
        if self.wandb:
            self.wandb.finish()
        try:  # matplotlib is optional
            print("curves:", plot(os.path.dirname(self.metrics.name)))
        except ImportError:
            pass


def plot(run_dir):
    """{run_dir}/curves.png: reward and eval accuracy by samples and time; the trainer's time."""
    from matplotlib.figure import Figure
    rows = [json.loads(line) for line in open(f"{run_dir}/metrics.jsonl")]
    steps, evals = [r for r in rows if "loss" in r], [r for r in rows if "eval_accuracy" in r]
    at = {r["version"]: r for r in steps}
    fig = Figure(figsize=(15, 4), layout="tight")
    ax = fig.subplots(1, 3)
    for a, x, label in zip(ax, ("samples", "elapsed_s"), ("trained samples", "wall-clock (s)")):
        a.plot([r[x] for r in steps], [r["reward_mean"] for r in steps], label="train reward")
        # an eval row has no sample count: take its version's step row's (0 before the first step)
        ex = [e.get(x, at.get(e["version"], {}).get(x, 0)) for e in evals]
        a.plot(ex, [e["eval_accuracy"] for e in evals], "o-", label="held-out accuracy (greedy)")
        a.set(xlabel=label, ylim=(0, 1))
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
    print(plot(sys.argv[1]))
