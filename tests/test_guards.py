"""Nothing lost, no one in: a resume keeps every row, a run never overwrites another's checkpoint,
the store listens on loopback alone and unpickles nothing but data, graders that evaluate the
model's text are refused, and bad input stops in one line. Real stores, real processes."""
import ast
import json
import os
import pickle
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest
import torch

import configurator
import metrics
import reward
import sync
from conftest import ROOT, free_port
from e2e import command, metrics as read_metrics, ours, start, train


def test_a_resume_keeps_every_row_before_its_checkpoint(tmp_path):
    """Rows without a step (an older version's wait reports) stay, rows of later steps go, a torn
    last line (a kill mid-write) is dropped instead of failing the run; the file is replaced whole
    and then appended to."""
    path = tmp_path / "samples.jsonl"
    rows = [{"step": 0, "x": 1}, {"dropped": "flat"}, {"step": 1}, {"step": 2}, {"step": 3}]
    path.write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in rows) + b'{"step": 4, "x')
    f = metrics.reopen(str(path), 2)
    f.write(json.dumps({"step": 2, "new": True}) + "\n")
    f.close()
    got = [json.loads(line) for line in open(path)]
    assert got == [rows[0], rows[1], rows[2], {"step": 2, "new": True}]
    assert not (tmp_path / "samples.jsonl.tmp").exists()
    metrics.reopen(str(path), 0).close()  # a fresh run starts empty
    assert path.read_text() == ""


def test_a_rerun_never_overwrites_a_checkpoint_and_a_resume_must_match_it(tiny, tmp_path):
    """A run checkpoints at its end by default; the same command again stops at once, before
    anything starts, naming the checkpoint's version, and leaves the files as they were. A resume
    with another seed or eval_n (another prompt stream) stops, naming both values."""
    out = tmp_path / "run"
    train(out, "--max_steps=1", "--eval_every=0")
    ckpt = torch.load(out / "ckpt.pt", weights_only=True)
    assert ckpt["version"] == 1 and ckpt["config"]["seed"] == 1337
    before = {f: (out / f).read_bytes() for f in ("ckpt.pt", "metrics.jsonl")}
    for args, message in [
            ([], f"error: {out} has a checkpoint at version 1: --resume to continue, or another "
                 "--out_dir"),
            (["--resume", "--seed=7", "--eval_n=30"], "error: --resume: "
             f"{out}/ckpt.pt was made with seed=1337, eval_n=20 (now 7, 30): resume with those")]:
        t0 = time.time()
        p = subprocess.run([sys.executable, "train.py", "config/tiny.py", f"--out_dir={out}",
                            "--max_steps=1", *args], cwd=ROOT, capture_output=True, text=True,
                           timeout=120)
        assert p.returncode != 0 and message in p.stderr, p.stderr[-3000:]
        assert "Traceback" not in p.stderr and time.time() - t0 < 60
    assert before == {f: (out / f).read_bytes() for f in before}


# train.py's defaults, read without running it
DEFAULTS = {n.targets[0].id: n.value.value for n in ast.parse(open(f"{ROOT}/train.py").read()).body
            if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)}
DEFAULTS["model"] = os.path.join(ROOT, "data/tiny")


def test_only_rank_0_needs_the_checkpoint(tiny, tmp_path, monkeypatch):
    """Several nodes: rank 0 reads ckpt.pt; a rank on another node has no copy, and goes on."""
    cfg = {**configurator.apply(dict(DEFAULTS), []), "resume": True, "out_dir": str(tmp_path)}
    monkeypatch.setenv("GROUP_WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "1")
    configurator.check(cfg, 2)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit):
        configurator.check(cfg, 2)




def test_the_store_listens_on_loopback_alone():
    port = free_port()
    store = sync.open_store("127.0.0.1", port, True, 10)
    listening = [c.laddr for c in psutil.Process().net_connections()
                 if c.status == "LISTEN" and c.laddr.port == port]
    assert listening and all(a.ip == "127.0.0.1" for a in listening), listening
    store.set("k", "v")
    assert sync.open_store("127.0.0.1", port, False, 10).get("k") == b"v"


class Boom:
    def __reduce__(self):
        return os.system, ("echo pwned > /dev/null",)


def test_nothing_but_data_is_unpickled_from_a_peer():
    """What an engine sends (dicts, text, numpy arrays) and a CUDA tensor's IPC handle (its
    parts, built here on CPU) load; a payload that would call a function is refused."""
    group = {"kind": "group", "prompt": [{"role": "user", "content": "hi"}], "completions": [
        {"ids": np.arange(5, dtype=np.int32), "logprobs": np.zeros(5, np.float32), "reward": 1.0,
         "text": "x", "cut": False}], "version_min": 3, "stats": {"rollout_steps": 2}}
    back = sync.loads(pickle.dumps(group))
    assert np.array_equal(back["completions"][0]["ids"], group["completions"][0]["ids"])
    from torch.multiprocessing.reductions import rebuild_cuda_tensor
    handle = (rebuild_cuda_tensor, (torch.Tensor, torch.Size([4]), (1,), 0, torch.UntypedStorage,
                                    torch.bfloat16, 0, b"h", 8, 0, False, b"r", 0, b"e", True))
    assert sync.loads(pickle.dumps(handle)) == handle
    for payload in (Boom(), [Boom()], {"stats": Boom()}):
        with pytest.raises(pickle.UnpicklingError, match="refused to unpickle posix.system"):
            sync.loads(pickle.dumps(payload))


def test_a_run_names_a_foreign_heartbeat_and_listens_on_loopback(tiny, tmp_path):
    """Rank 0's store listens on 127.0.0.1 alone. A real store client writes a malformed heartbeat
    into a running run's store: the run stops within seconds, naming the key and what it held
    (not blaming the store)."""
    p = start(tmp_path, "--eval_every=0")
    port = int(next(a for a in p.args if a.startswith("--rollout_port=")).split("=")[1])
    rank0 = [q for q in ours(tmp_path) if "train.py" in q.cmdline() and "torch.distributed.run"
             not in q.cmdline()][0]
    bound = [c.laddr.ip for c in rank0.net_connections() if c.laddr.port == port
             and c.status == "LISTEN"]
    assert bound == ["127.0.0.1"], bound
    client = sync.open_store("127.0.0.1", port, False, 10)
    for _ in range(100):  # the engine rewrites its key every second: write it often
        try:
            client.set("beat0", "x")
        except RuntimeError:  # (DistNetworkError) the run has stopped: the store is gone
            break
        time.sleep(0.05)
    _, err = p.communicate(timeout=60)
    assert p.returncode != 0 and "heartbeat key 'beat0' holds b'x'" in err, err[-3000:]
    assert not ours(tmp_path)


def test_graders_that_run_the_models_text_are_refused_unless_asked():
    cfg = {"task": "rg:n_queens", "seed": 1, "eval_n": 5, "unsafe_graders": False,
           "max_turns": 1}
    with pytest.raises(ValueError, match="evaluates the model's text as code.*--unsafe_graders"):
        reward.load_task(cfg)
    assert reward.load_task(dict(cfg, unsafe_graders=True))["eval"]


def limits(text, answer):  # run in a grader process -> how many of reward.LIMITS hold there
    import resource  # (a grade is a number: the count, not the values, comes back)
    return float(sum(resource.getrlimit(getattr(resource, k))[0] == v
                     for k, v in reward.LIMITS.items()))


def hog(text, answer):
    return len(bytearray(9 << 30))  # past the 8 GiB address space


def nan(text, answer):
    return float("nan")


def test_grader_processes_are_confined_and_a_nan_is_no_grade():
    graders = reward.Workers(workers=1, timeout_s=20)
    for key, fn in enumerate((limits, hog, nan)):
        graders.submit(key, fn, "", "")
    got = {}
    while len(got) < 3:
        got.update({k: (r, failed) for k, r, failed in graders.poll()})
        time.sleep(0.01)
    graders.close()
    assert got[0] == (len(reward.LIMITS), False)  # every limit, as set
    assert got[1] == (None, True)  # MemoryError: failed, the process serves on
    assert got[2][1] is True  # a NaN grade is a failed grade, not a success


@pytest.mark.parametrize("setup, args, message", [
    (None, ["--temperature=0"], "temperature=0.0 must be > 0"),
    (None, ["--eval_n=0"], "eval_n=0 with eval_every=3: eval_n >= 1, or --eval_every=0"),
    ("rows", ["--task=gsm8k", "--eval_n=5"], "eval_n=5 leaves none of"),
    ("number", ["--task=gsm8k"], ":2: expected a JSON object (UTF-8) with a text question"),
    ("latin1", ["--task=gsm8k"], ":1: expected a JSON object (UTF-8)"),
    ("noweights", [], "has no weights (*.safetensors)"),
    ("json", [], "is not a .py file of bare assignments"),
    ("typo", [], ":2 does not run: SyntaxError"),
    (None, ["--task=rg:countdown"], "task 'rg:countdown': its scorer evaluates the model's text"),
    ("window", [], "'qwen2' uses sliding windows, softcapping or attention sinks"),
    (None, ["--task=env:tests/toy_envs.py:WrongShape"],
     "step() returned (1, 2) (tuple): want (observation, reward, done)"),
    (None, ["--task=env:tests/toy_envs.py:NotText"], "step() returned the observation 5 (int)"),
    (None, ["--task=env:tests/toy_envs.py:NoStep"], "NoStep has no step method"),
    (None, ["--task=env:tests/nowhere.py:X"], "no file 'tests/nowhere.py'"),
    (None, ["--task=env:toy_envs:Nope"], "task 'env:toy_envs:Nope': ModuleNotFoundError"),
])
def test_bad_input_is_one_line(tiny, tmp_path, setup, args, message):
    data = tmp_path / "data.jsonl"
    extra = []
    if setup in ("rows", "number", "latin1"):
        rows = {"rows": b'{"question": "q", "answer": "1"}\n' * 3,
                "number": b'{"question": "q", "answer": 1}\n{"question": 5, "answer": 1}\n',
                "latin1": '{"question": "caf\xe9", "answer": 1}\n'.encode("latin-1")}
        data.write_bytes(rows[setup])
        extra = [f"--data_path={data}"]
    elif setup == "window":  # the tiny model, attending within 64 tokens
        import shutil
        shutil.copytree(f"{ROOT}/data/tiny", tmp_path / "m")
        conf = json.load(open(tmp_path / "m/config.json"))
        conf.update(sliding_window=64, use_sliding_window=True)
        json.dump(conf, open(tmp_path / "m/config.json", "w"))
        extra = [f"--model={tmp_path}/m"]
    elif setup == "noweights":
        (tmp_path / "m").mkdir()
        (tmp_path / "m/config.json").write_text(open(f"{ROOT}/data/tiny/config.json").read())
        extra = [f"--model={tmp_path}/m"]
    elif setup in ("json", "typo"):
        conf = tmp_path / ("c.json" if setup == "json" else "c.py")
        conf.write_text('{"lr": 1}' if setup == "json" else "lr = 1e-3\nmax_steps = = 3\n")
        extra = [str(conf)]
    p = subprocess.run([sys.executable, "train.py", "config/tiny.py", f"--out_dir={tmp_path}/o",
                        *extra, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert len(errors) == 1 and message in errors[0], p.stderr[-3000:]


def test_an_fp16_forward_that_overflows_stops_at_once(tiny, tmp_path):
    """fp16, an absurd step (lr = 1e30, a small loss scale so that step 0 applies it): the next
    forward overflows float16's range. No smaller loss scale helps a forward: the run stops at
    that step, saying to use bfloat16, instead of halving the scale 16 times."""
    p = subprocess.run(command(tmp_path, "--trainer_dtype=float16", "--rollout_dtype=float16",
                               "--lr=1e30", "--loss_scale=2", "--eval_every=0", "--max_steps=20",
                               "--max_staleness=0"),
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode != 0 and "overflowed float16's range: use bfloat16" in p.stderr, \
        p.stderr[-3000:]
    steps, _ = read_metrics(tmp_path)
    assert 1 <= len(steps) < 20 and all(m["loss_scale"] == 2 for m in steps), steps
