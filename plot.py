"""plot.py: a run's curves, from its metrics.jsonl, into OUT_DIR/curves.png (`make demo` and
`make agent` draw theirs with it).

  python plot.py OUT_DIR [--baseline=ACCURACY|RUN_DIR]

Reward and held-out accuracy by trained samples and by wall-clock, and the trainer's time per
step (waiting, training, pushing weights). A task with a tool adds its calls per answer; the
baseline is a held-out accuracy to draw beside (the same model without the tool), or a run
directory: its held-out curve if it trained (a control arm), else its first eval.
"""
import json
import os
import sys


def plot(run_dir, baseline=None):
    from matplotlib.figure import Figure
    rows = [json.loads(line) for line in open(f"{run_dir}/metrics.jsonl")]
    steps = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval_accuracy" in r]
    other = []  # a baseline run's evals: a line if it trained (a control arm), else its level
    if baseline and os.path.isdir(baseline):
        other = [json.loads(line) for line in open(f"{baseline}/metrics.jsonl")]
        if not any("loss" in r for r in other):
            baseline, other = next(r["eval_accuracy"] for r in other if "eval_accuracy" in r), []
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
                   label="turns - 1 per answer (tool calls, replies)")
        if other:
            o_at = {r["version"]: r for r in other if "loss" in r}
            o_ev = [r for r in other if "eval_accuracy" in r]
            a.plot([e.get(x, o_at.get(e["version"], {}).get(x, 0)) for e in o_ev],
                   [e["eval_accuracy"] for e in o_ev], "s:", color="gray",
                   label=f"held-out, {os.path.basename(baseline.rstrip('/'))}")
        elif baseline is not None:
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
    args = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--"))
    dirs = [a for a in sys.argv[1:] if not a.startswith("--")]
    if len(dirs) != 1:
        sys.exit(__doc__)
    print(plot(dirs[0], args.get("baseline")))
