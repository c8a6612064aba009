"""metrics.py: rank 0's log: metrics.jsonl (a row per step and per eval), samples.jsonl (a few
completions a step), the console, wandb (wandb_log) and curves.png (`python metrics.py OUT_DIR`
redraws it). The README lists the keys worth watching."""
import json
import os
import resource
import sys
import time

# per-token sums each rank adds up over its micro-batches, all-reduced once per step
SUMS = ("loss", "bounded_fresh", "fresh", "bounded_stale", "stale", "shift_fresh", "shift_stale",
        "computed", "real")


def token_sums(loss, bounded, logp, behav, mask, fresh, positions):
    """A micro-batch's share of SUMS; fresh: tokens sampled by the weights being trained."""
    import torch
    fresh, stale = fresh & (mask > 0), ~fresh & (mask > 0)
    shift = (logp.detach() - behav).abs()  # |log rho|; on fresh tokens ~1e-6 in fp32, or bad sync
    parts = (loss.detach(), bounded & fresh, fresh, bounded & stale, stale, shift * fresh,
             shift * stale, *torch.tensor(positions, device=logp.device))
    return torch.stack([x.float().sum() for x in parts])


def mean(xs):
    return sum(xs) / len(xs)


def ratio(a, b):
    return a / b if b else None  # None: no such tokens this step


def reopen(path, start):
    """A resumed run keeps the lines before its checkpoint. Line-buffered: a crash loses nothing."""
    kept = open(path).readlines() if start and os.path.exists(path) else []
    f = open(path, "w", buffering=1)
    f.writelines(line for line in kept if json.loads(line)["step"] < start)
    return f


class Log:
    def __init__(self, cfg, start, ckpt):
        self.t_start = time.perf_counter() - ckpt.get("elapsed_s", 0.0)
        self.samples, self.gen_tokens = ckpt.get("samples", 0), ckpt.get("gen_tokens", 0)
        self.metrics = reopen(f"{cfg['out_dir']}/metrics.jsonl", start)
        self.completions = reopen(f"{cfg['out_dir']}/samples.jsonl", start)
        self.wandb = None
        if cfg["wandb_log"]:
            import wandb
            self.wandb = wandb.init(project=cfg["wandb_project"], config=cfg, dir=cfg["out_dir"],
                                    name=cfg["wandb_run_name"] or None)

    def state(self):  # for a checkpoint
        return {"samples": self.samples, "gen_tokens": self.gen_tokens,
                "elapsed_s": time.perf_counter() - self.t_start}

    def write(self, row, keys):
        print(json.dumps(row), file=self.metrics)
        if self.wandb:
            self.wandb.log({k: row[k] for k in keys}, step=row["version"])

    def step(self, step, groups, seen, sums, fleet, **extra):
        """groups: the trained batch; seen: every group taken from the buffer; sums: SUMS."""
        from reward import is_flat
        s, comps = dict(zip(SUMS, sums)), [c for g in groups for c in g["completions"]]
        engines = range(len(fleet.procs))
        stale = [step - min(c["versions"], default=step) for c in comps]
        self.samples += len(comps)
        self.gen_tokens += sum(len(c["ids"]) for g in seen for c in g["completions"])
        m = {"step": step, "version": step + 1,
             "reward_mean": mean([c["reward"] for g in seen for c in g["completions"]]),
             "response_len_mean": mean([len(c["ids"]) for c in comps]),
             "staleness_mean": mean(stale), "staleness_max": max(stale),
             "mixed_version_frac": mean([len(set(c["versions"])) > 1 for c in comps]),
             "flat_frac": mean([is_flat(g) for g in groups]),
             "engine_groups": [sum(g["engine"] == e for g in groups) for e in engines],
             "loss": s["loss"], "logprob_mismatch": ratio(s["shift_fresh"], s["fresh"]),
             "logprob_shift_stale": ratio(s["shift_stale"], s["stale"]),
             "bounded_frac_fresh": ratio(s["bounded_fresh"], s["fresh"]),
             "bounded_frac_stale": ratio(s["bounded_stale"], s["stale"]),
             "cut_frac": mean([c["cut"] for c in comps]),  # cut at max_new_tokens
             "stale_token_frac": ratio(s["stale"], s["fresh"] + s["stale"]),
             "pad_frac": 1 - s["real"] / s["computed"],
             "train_tokens_per_s": (s["fresh"] + s["stale"]) / extra["t_train_s"],
             "dropped_stale": fleet.buffer.dropped_stale, "dropped_flat": fleet.buffer.dropped_flat,
             "trainer_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
             "prompts": sorted(g["pos"] for g in groups), **self.state(), **extra,
             **fleet.rollout_stats()}
        print(f"step {step:4d} | reward {m['reward_mean']:.3f} | stale {m['staleness_mean']:.2f}/"
              f"{m['staleness_max']} | {m['train_tokens_per_s']:.0f} tok/s | wait "
              f"{m['t_wait_s']:.2f}s train {m['t_train_s']:.2f}s sync {m['t_sync_s']:.2f}s",
              flush=True)
        self.write(m, [k for k, v in m.items() if isinstance(v, (int, float))])
        for g in groups[:2]:
            for c in g["completions"][:2]:
                print(json.dumps({"step": step, "prompt": g["prompt"], "completion": c["text"],
                                  "reward": c["reward"], "versions": sorted(set(c["versions"]))}),
                      file=self.completions)
        self.evals(fleet.evals)

    def evals(self, evals):
        while evals:
            e = evals.pop(0)
            lo, hi = e["eval_versions"]  # it runs across loads: the weights its tokens came from
            print(f"eval @ version {e['version']}: accuracy {e['eval_accuracy']:.3f} "
                  f"(n={e['eval_n']}, weights {lo}..{hi})", flush=True)
            self.write({"step": e["version"], "elapsed_s": e["t"] - self.t_start,
                        **{k: e[k] for k in ("version", "eval_accuracy", "eval_n",
                                             "eval_versions")}}, ["eval_accuracy"])

    def close(self, evals):
        self.evals(evals)
        self.metrics.close()
        self.completions.close()
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
