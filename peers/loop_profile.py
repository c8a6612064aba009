"""bench.py --engine's profile: py-spy on the rollout process of a loop run, the share of its
main thread's wall-clock in each of Rollout's methods (waiting included), vLLM's own step split
out of ours. Needs py-spy (pip install py-spy); without it, says so."""
import os
import shutil
import subprocess
import sys
import time


def profile(cmd, out, cwd, seconds):  # cmd: a train.py run writing to out -> {phase: share}
    import psutil
    spy = shutil.which("py-spy", path=os.path.dirname(sys.executable) + os.pathsep
                       + os.environ["PATH"])
    if not spy:
        return {"skipped": "pip install py-spy"}
    os.makedirs(out, exist_ok=True)
    run = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while not (os.path.exists(f"{out}/metrics.jsonl") and open(f"{out}/metrics.jsonl").read()):
            if run.poll() is not None:
                sys.exit(f"the profiled run failed: see {out}")
            time.sleep(0.5)  # the engine is up and one batch went through
        pid = next(p.pid for p in psutil.Process(run.pid).children(recursive=True)
                   if "rollout.py" in " ".join(p.cmdline()))
        subprocess.run([spy, "record", "--pid", str(pid), "--duration", str(seconds), "--idle",
                        "--format", "raw", "-o", f"{out}/raw.txt"], check=True,
                       capture_output=True)
    finally:
        for p in [*psutil.Process(run.pid).children(recursive=True), run]:
            p.kill()
        run.wait()
    return phases(f"{out}/raw.txt")


def phases(path):  # py-spy's raw stacks -> {phase: share of the loop thread's samples}
    shares, total = {}, 0
    for line in open(path):  # "frame;frame;... count", a frame "Class.method (file)"
        stack, count = line.rsplit(" ", 1)
        names = [f.split(" ")[0] for f in stack.split(";")]
        if "Rollout.run" not in names:
            continue  # not the loop's thread
        phase = (names + ["Rollout.run"])[names.index("Rollout.run") + 1]
        if phase == "Rollout.step":  # vLLM's LLMEngine.step: its engine core, its output processor
            below = (names + ["?"] * 4)[names.index("LLMEngine.step") + 1:] \
                if "LLMEngine.step" in names else None
            phase = "step: ours" if below is None else "step: vLLM " + (
                below[2].split(".")[-1] if below[0] == "InprocClient.get_output" else "outputs")
        shares[phase] = shares.get(phase, 0) + int(count)
        total += int(count)
    return {k: round(v / total, 3) for k, v in sorted(shares.items(), key=lambda kv: -kv[1])}
