"""metrics.py: rank 0's log: metrics.jsonl (a row per step and per eval), samples.jsonl (a few
completions a step, and of dropped groups while the trainer waits), the console and wandb
(wandb_log); `python bench.py --plot OUT_DIR` draws curves.png. The README lists the keys worth
watching."""
import json
import os
import resource
import time

# per-token sums each rank adds up over its micro-batches, all-reduced once per step
SUMS = ("loss", "fresh", "bounded_stale", "stale", "shift_fresh", "shift_stale", "whole",
        "shift_whole", "computed", "real")


def token_sums(loss, bounded, logp, behav, mask, fresh, positions):
    """A micro-batch's share of SUMS; fresh: tokens sampled by the weights being trained."""
    import torch
    fresh, stale = fresh & (mask > 0), ~fresh & (mask > 0)
    whole = fresh & (fresh | (mask == 0)).all(1, keepdim=True)  # all by them, tokens and KV cache
    shift = (logp.detach() - behav).abs()  # |log rho|: ~1e-7 on whole completions in fp32
    parts = (loss.detach(), fresh, bounded & stale, stale, shift * fresh,
             shift * stale, whole, shift * whole, *torch.tensor(positions, device=logp.device))
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
                                    name=cfg["out_dir"])

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
        engines = range(fleet.engines)
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
             # the health metric: a jump means the weights or the sampled distribution are wrong
             "loss": s["loss"], "logprob_mismatch": ratio(s["shift_whole"], s["whole"]),
             # fresh tokens of completions that lived through a load: old weights made their KV
             "logprob_shift_reloaded": ratio(s["shift_fresh"] - s["shift_whole"],
                                             s["fresh"] - s["whole"]),
             "logprob_shift_stale": ratio(s["shift_stale"], s["stale"]),
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
        self.sample(groups[:2], step=step)
        self.evals(fleet.evals)

    def sample(self, groups, **tag):  # samples.jsonl: two answers of each group
        for g in groups:
            for c in g["completions"][:2]:
                print(json.dumps({**tag, "prompt": g["prompt"], "completion": c["text"], "reward":
                                  c["reward"], "versions": sorted(set(c["versions"]))}),
                      file=self.completions)

    def waiting(self, text, groups):  # buffer.get: a wait with nothing to train, what it dropped
        print(text, flush=True)
        for g in groups[-2:]:
            self.sample([g], dropped=g["dropped"])

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
