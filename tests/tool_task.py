"""A task with a tool for the tiny model, put into every process of a run (trainer, engine, its
workers) by a sitecustomize module: install(dir) writes it; put dir and ROOT on PYTHONPATH.
The arithmetic prompts; a model turn ends where its text reaches STOP (the random model writes one
within a few tokens about half the time) and the tool answers " = N". By the answer's length, a
few calls misbehave: they raise, hang or return a megabyte."""
import os
import time

STOP = "1"


def turn(text, answer):
    if not text.endswith(STOP):
        return None
    if os.environ.get("TOOL_MISBEHAVES") and len(text) % 11 < 3:
        [lambda: 1 / 0, lambda: time.sleep(60), lambda: None][len(text) % 11]()
        return "x" * 2**20
    return f" = {len(text)}"


def patch():
    import reward
    load = reward.load_task
    reward.load_task = lambda cfg: dict(load(cfg), turn=turn, stop=STOP)


def install(path):
    path.mkdir(exist_ok=True)
    (path / "sitecustomize.py").write_text("import tool_task\ntool_task.patch()\n")
    return path
