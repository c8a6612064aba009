"""What the end-to-end tests (test_runs.py, test_faults.py, test_config.py, test_guards.py) share:
launching the real thing on the tiny model (torchrun, trainer ranks, vLLM rollout processes, on one
node or two), watching its processes, reading what it wrote, and its trackers' files. Not a test
module."""
import glob
import json
import os
import shutil
import sqlite3
import struct
import subprocess
import sys
import time

import psutil

from conftest import ROOT, free_port

KEYS = ("step version reward_mean response_len_mean staleness_mean staleness_max "
        "dropped_stale dropped_flat loss bounded_frac_stale "
        "cut_frac logprob_mismatch logprob_shift_reloaded grad_norm samples "
        "gen_tokens t_wait_s t_train_s t_sync_s elapsed_s borrowed_frac engine_groups "
        "turns_mean rollout_running_frac rollout_pause_s "
        "reward_failed rollout_grade_s").split()
SYNC = ("--max_staleness=0", "--eval_every=0")


def command(out, *overrides, nproc=1):
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
            f"--master_port={free_port()}", "train.py", "config/tiny.py", f"--out_dir={out}",
            f"--rollout_port={free_port()}", *overrides]


def ours(out):
    """Every process of the run writing to `out` (torchrun, trainer ranks, the rollout process)
    still alive."""
    return [q for q in psutil.process_iter(["cmdline"])
            if str(out) in " ".join(q.info["cmdline"] or [])]


def metrics(out):
    lines = [json.loads(line) for line in open(out / "metrics.jsonl")]
    return [m for m in lines if "loss" in m], [m for m in lines if "eval_accuracy" in m]


def train(out, *overrides, nproc=1, env=None):
    p = subprocess.run(command(out, *overrides, nproc=nproc), cwd=ROOT, capture_output=True,
                       text=True, timeout=600, env=env)
    assert not ours(out), "processes left behind"
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    return (*metrics(out), p)


def start(out, *overrides, steps=2):
    """Launch a long run in the background and return it once `steps` optimizer steps are logged."""
    p = subprocess.Popen(command(out, "--max_steps=1000", *overrides), cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 180
    while time.time() < deadline and p.poll() is None:
        if ((out / "metrics.jsonl").exists()
                and (out / "metrics.jsonl").read_text().count("\n") >= steps):
            return p
        time.sleep(0.2)
    raise AssertionError(f"no {steps} steps within 180 s: " + p.communicate()[1][-3000:])


HOOKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hooks")


def hook(tmp_path, name):
    """Put tests/hooks/{name}.py in tmp_path/hook as sitecustomize.py, which every Python process of
    a run started with the environment returned imports first (PYTHONPATH: that folder, then the
    repository)."""
    hookdir = tmp_path / "hook"
    hookdir.mkdir()
    shutil.copy(os.path.join(HOOKS, f"{name}.py"), hookdir / "sitecustomize.py")
    return dict(os.environ, PYTHONPATH=f"{hookdir}{os.pathsep}{ROOT}")


def two_nodes(out, *overrides):
    """Two torchrun agents on this machine as two nodes (static rendezvous), one trainer rank and
    one engine each."""
    launch = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
              "--master_addr=127.0.0.1", f"--master_port={free_port()}"]
    run = ["train.py", "config/tiny.py", f"--out_dir={out}", f"--rollout_port={free_port()}",
           *overrides]
    return [subprocess.Popen(launch + [f"--node_rank={n}"] + run, cwd=ROOT, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE) for n in (0, 1)]


def kill_mid_run(tmp_path, what, find):
    """A two-node run; after two steps the process find(nodes)[0] is SIGKILLed: every process of
    both nodes must be gone, non-zero, within 20 s. -> (the process, each node's stderr)"""
    nodes = two_nodes(tmp_path, "--eval_every=0", "--max_steps=1000", "--timeout_s=60")
    deadline = time.time() + 180
    while len(metrics(tmp_path)[0]) < 2 if (tmp_path / "metrics.jsonl").exists() else True:
        assert time.time() < deadline and all(p.poll() is None for p in nodes)
        time.sleep(0.2)
    victim = find(nodes)[0]
    t0 = time.time()
    victim.kill()
    while ours(tmp_path):
        time.sleep(0.1)
    took = time.time() - t0
    errs = [p.communicate(timeout=60)[1] for p in nodes]
    print(f"\nnode 1's {what} SIGKILLed: both nodes gone {took:.1f} s later")
    assert all(p.returncode != 0 for p in nodes) and took < 20, errs[0][-3000:]
    return victim, errs


def wandb_records(wandb_dir):
    """Every record of the one offline run under WANDB_DIR, read from its .wandb file as wandb's
    own protobufs. The file is a LevelDB log: a 7-byte header (":W&B", magic, version), then 32 KiB
    blocks of chunks, each with a 7-byte header (crc, length, type: 1 whole, 2 first, 3 middle,
    4 last); a block's tail shorter than a header is padding."""
    from wandb.proto.wandb_internal_pb2 import Record
    [path] = glob.glob(f"{wandb_dir}/wandb/offline-run-*/run-*.wandb")
    data, pos, chunk, records = open(path, "rb").read(), 7, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:
            pos += 32768 - pos % 32768
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:  # zeros: the end
            break
        chunk, pos = chunk + data[pos + 7:pos + 7 + n], pos + 7 + n
        if kind in (1, 4):
            records.append(Record.FromString(chunk))
            chunk = b""
    return records


def wandb_run(wandb_dir):  # -> run name, config, logged rows (wandb's own _keys left out)
    records = wandb_records(wandb_dir)
    [run] = [r.run for r in records if r.HasField("run")]
    items = lambda update: {k: json.loads(i.value_json) for i in update
                            if not (k := i.key or "/".join(i.nested_key)).startswith("_")}
    rows = [items(r.history.item) for r in records if r.HasField("history")]
    return run.display_name, items(run.config.update), rows


def trackio_run(trackio_dir):  # -> run name, config, logged rows, from its SQLite file
    db = sqlite3.connect(f"{trackio_dir}/nanoasync.db")
    [(name, config)] = db.execute("SELECT run_name, config FROM configs").fetchall()
    rows = [{**json.loads(m), "step": step}  # trackio keeps the step in a column of its own
            for step, m in db.execute("SELECT step, metrics FROM metrics ORDER BY id")]
    config = {k: v for k, v in json.loads(config).items() if not k.startswith("_")}
    return name, config, rows
