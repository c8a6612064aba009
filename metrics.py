"""metrics.py: rank 0's log: metrics.jsonl (and a tracker), samples.jsonl, the console.

Runs on trainer rank 0 (token_sums on every rank, inside the loss). Rows are appended as they
happen and never rewritten, except by a resume, which keeps exactly the rows before its
checkpoint (reopen)."""
import importlib, json, os, time
from statistics import fmean as mean

# per-token sums over a rank's micro-batches, all-reduced a step
SUMS = "loss fresh bounded_stale stale shift_fresh whole shift_whole k3_whole".split()


def token_sums(loss, bounded, logp, behav, mask, fresh):  # a micro-batch's share of SUMS
    import torch
    fresh, stale = fresh & (mask > 0), ~fresh & (mask > 0)
    whole = fresh & (fresh | (mask == 0)).all(1, keepdim=True)  # a fresh KV cache too
    log_rho = logp.detach() - behav
    # k3 = rho - 1 - log rho: KL(vLLM || trainer), unbiased, >= 0
    k3 = torch.expm1(log_rho) - log_rho
    parts = (loss.detach(), fresh, bounded & stale, stale, log_rho.abs() * fresh, whole,
             log_rho.abs() * whole, k3 * whole)
    return torch.stack([x.float().sum() for x in parts])


def ratio(a, b):
    return a / b if b else None  # None: no such tokens this step


def reopen(path, start):
    """A resumed run keeps every row written before its checkpoint: rows of steps below `start`,
    and rows with no step (a report written while waiting, by an older version). A torn last line
    (a kill or a full disk cut it) is dropped, whatever else it held. The kept rows go to a new
    file that replaces the old one in one rename, so a crash here loses nothing; only then is the
    file opened to append. A fresh run (start 0) begins an empty file."""
    kept = []
    for line in open(path, "rb") if start and os.path.exists(path) else ():
        try:
            row = json.loads(line)
        except ValueError:  # torn, or not UTF-8: not a row we wrote whole
            continue
        if not isinstance(row, dict) or row.get("step", -1) < start:
            kept.append(line)
    with open(path + ".tmp", "wb") as f:
        f.writelines(kept)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)
    return open(path, "a", buffering=1)


class Log:
    def __init__(self, cfg, start, ckpt):
        self.cfg = cfg
        self.run = None  # wandb and trackio share one API
        if cfg["tracker"]:
            tracker = importlib.import_module(cfg["tracker"])
            name = os.path.basename(os.path.abspath(cfg["out_dir"]))
            self.run = tracker.init(project="nanoasync", name=name, config=cfg)
        self.t_start = time.perf_counter() - ckpt.get("elapsed_s", 0.0)
        self.gen_tokens = ckpt.get("gen_tokens", 0)
        self.next_step = start  # the step whose batch we wait for
        self.metrics = reopen(f"{cfg['out_dir']}/metrics.jsonl", start)
        self.completions = reopen(f"{cfg['out_dir']}/samples.jsonl", start)

    def state(self):  # for a checkpoint
        return {"gen_tokens": self.gen_tokens, "elapsed_s": time.perf_counter() - self.t_start}

    def step(self, step, groups, seen, sums, fleet, **extra):
        """Step `step`'s row: to metrics.jsonl (and the tracker), one console line, two answers
        of two groups to samples.jsonl, then the evals that came. Returns nothing. groups: the
        batch trained; seen: every group taken from the buffer for it (the dropped too: the
        reward is the engines' whole output); sums: SUMS, over all ranks; extra: train.py's
        timings and counters, as they are. The rest is summed here (fleet.rollout_stats)."""
        s = dict(zip(SUMS, sums))
        comps = [c for g in groups for c in g["completions"]]
        taken = [c for g in seen for c in g["completions"]]  # dropped ones too
        stale = [step - int(c["versions"].min()) for c in comps]
        n = [len(c["ids"]) for c in comps]
        self.gen_tokens += int(sum(c["mask"].sum() for c in taken))
        m = {"step": step, "version": step + 1, "samples": (step + 1) * len(comps),
             "reward_mean": mean(c["reward"] for c in taken), "response_len_mean": mean(n),
             "staleness_mean": mean(stale), "staleness_max": max(stale),
             "engine_groups": [sum(g["engine"] == e for g in groups) for e in range(fleet.engines)],
             # the health metric: a jump means wrong weights or sampling
             "loss": s["loss"], "logprob_mismatch": ratio(s["shift_whole"], s["whole"]),
             "logprob_kl_k3": ratio(s["k3_whole"], s["whole"]),
             # fresh tokens over older weights' KV cache (across a load)
             "logprob_shift_reloaded": ratio(
                 s["shift_fresh"] - s["shift_whole"], s["fresh"] - s["whole"]),
             "bounded_frac_stale": ratio(s["bounded_stale"], s["stale"]),
             "cut_frac": mean(c["cut"] for c in comps),  # at max_new_tokens
             "turns_mean": mean(c["turns"] for c in comps),  # tool calls + 1
             "env_token_frac": 1 - sum(c["mask"].sum() for c in comps) / sum(n),
             "train_tokens_per_s": (s["fresh"] + s["stale"]) / extra["t_train_s"],
             **{f"dropped_{why}": n for why, n in fleet.buffer.dropped.items()},
             "prompts": sorted(g["pos"] for g in groups), **self.state(), **extra,
             **fleet.rollout_stats()}
        eta = m["elapsed_s"] / (step + 1) * (self.cfg["max_steps"] - step - 1)
        print(f"step {step:4d}/{self.cfg['max_steps']} | reward {m['reward_mean']:.3f} | stale "
              f"{m['staleness_mean']:.2f}/{m['staleness_max']} | wait {m['t_wait_s']:.2f}s train "
              f"{m['t_train_s']:.2f}s sync {m['t_sync_s']:.2f}s | {m['train_tokens_per_s']:.0f} "
              "tok/s | eta " + (f"{eta / 60:.0f}m" if eta > 90 else f"{eta:.0f}s"), flush=True)
        self.write(m)
        self.next_step = step + 1
        self.sample(groups[:2], step=step)
        self.evals(fleet.evals)

    def sample(self, groups, **tag):  # two answers a group to samples.jsonl
        for g in groups:
            for c in g["completions"][:2]:
                row = {**tag, "prompt": g["prompt"], "completion": c["text"], "reward": c["reward"],
                       "versions": sorted(set(c["versions"].tolist()))}
                print(json.dumps(row), file=self.completions)

    def waiting(self, text, groups):  # buffer.get's report as it waits
        """Dropped groups' rows carry the step waited for, so a resume keeps only earlier ones."""
        print(text, flush=True)
        for g in groups[-2:]:
            self.sample([g], step=self.next_step, dropped=g["dropped"])

    def evals(self, evals):
        while evals:
            e = evals.pop(0)
            lo, hi = e["eval_versions"]  # its tokens' versions
            print(f"eval @ version {e['version']}: accuracy {e['eval_accuracy']:.3f} "
                  f"(n={e['eval_n']}, weights {lo}..{hi})", flush=True)
            row = {k: e[k] for k in e if k == "version" or k.startswith("eval_")}
            self.write({"step": e["version"], "elapsed_s": e["t"] - self.t_start, **row})

    def write(self, m):  # a metrics.jsonl row, and the tracker's
        print(json.dumps(m), file=self.metrics)
        if self.cfg["tracker"] == "trackio":  # its own "step"; ours may repeat
            self.run.log({k: v for k, v in m.items() if k != "step"}, step=m["step"])
        elif self.run:  # wandb's step must grow; an eval shares a step's
            self.run.log(m)

    def close(self, evals):
        self.evals(evals)
        if self.run:
            self.run.finish()
        self.metrics.close()
        self.completions.close()
