"""reward.py: the tasks, arithmetic and gsm8k (train and eval lists of {"id", "prompt", "answer"}),
and their graders. Graders run in processes beside the engine loop; a grade past its time limit is
killed with its process (sympy can spin in C, where no signal reaches) and scores 0, counted as a
failure like grader errors. Simplification: reward 1 or 0, no format reward."""
import ctypes
import json
import multiprocessing
import multiprocessing.connection
import os
import random
import re
import signal
import time
from collections import deque
from contextlib import suppress

JSONL_HINT = "a jsonl file of {question, answer} lines"


def problems(rows, instruction=""):
    """{"question", "answer"} rows -> the task's problems; gsm8k's answer "... #### 42" is 42."""
    return [{"id": i, "prompt": (r["question"] + " " + instruction).strip(),
             "answer": str(r["answer"]).split("####")[-1].strip()} for i, r in enumerate(rows)]


def arithmetic(seed, n_eval, max_operand=30):
    pairs = [(a, b) for a in range(1, max_operand + 1) for b in range(1, max_operand + 1)]
    random.Random(seed).shuffle(pairs)
    if n_eval >= len(pairs):
        raise ValueError(f"eval_n={n_eval} leaves none of the {len(pairs)} problems: lower eval_n")
    rows = [{"question": f"What is {a} + {b}?", "answer": a + b} for a, b in pairs]
    return problems(rows[n_eval:]), problems(rows[:n_eval])


def read_jsonl(path):
    rows = []
    for n, line in enumerate(open(path), 1):
        try:
            if line.strip():
                row = json.loads(line)
                rows.append({"question": row["question"], "answer": row["answer"]})
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{n}: expected a JSON object with question and answer ({e!r})")
    return rows


def gsm8k(data_path, eval_path, seed, n_eval, instruction=""):
    """data_path: a jsonl file or a hub dataset id (openai/gsm8k); no eval file: n_eval held out."""
    for key, path in (("data_path", data_path), ("eval_path", eval_path)):
        if path and (path.endswith(".jsonl") or os.sep in path) and not os.path.isfile(path):
            raise ValueError(f"{key} {path!r} not found: point --{key}= at {JSONL_HINT}")
    if not data_path:
        raise ValueError("task 'gsm8k' needs --data_path=FILE.jsonl (or a hub dataset id, online)")
    if os.path.isfile(data_path):
        train, test = read_jsonl(data_path), read_jsonl(eval_path) if eval_path else None
    else:
        try:
            import datasets
            ds = datasets.load_dataset(data_path, "main")
        except Exception as e:
            raise ValueError(f"data_path {data_path!r} is not a file nor a hub dataset that loads "
                             f"({type(e).__name__}: {str(e)[:150]}); offline? point --data_path= "
                             f"at {JSONL_HINT}") from None
        train, test = list(ds["train"]), list(ds["test"])
    if test is None:
        random.Random(seed).shuffle(train)
        train, test = train[:-n_eval], train[-n_eval:]
    return problems(train, instruction), problems(test[:n_eval], instruction)


def load_task(cfg):
    if cfg["task"] == "arithmetic":
        return arithmetic(cfg["seed"], cfg["eval_n"])
    if cfg["task"] == "gsm8k":
        return gsm8k(*(cfg[k] for k in ("data_path", "eval_path", "seed", "eval_n", "instruction")))
    raise ValueError(f"unknown task {cfg['task']!r}: use 'arithmetic' or 'gsm8k'")


def extract_answer(text):
    """The last \\boxed{...} content if there is one, else the last number; None if neither."""
    boxed = re.findall(r"\\boxed\{([^{}]*)\}", text)
    nums = re.findall(r"-?\d[\d,]*(?:\.\d+)?", boxed[-1] if boxed else text)
    return nums[-1].replace(",", "").rstrip(".") if nums else None


def grade_number(text, answer):
    pred = extract_answer(text)
    try:
        return float(pred is not None and abs(float(pred) - float(answer.replace(",", ""))) < 1e-6)
    except ValueError:
        return float(pred == answer.strip())


def grade_math(text, answer):
    import logging
    import math_verify  # its own timers (SIGALRM) are off: the time limit is the Graders' kill
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout is disabled": it is ours
    gold = math_verify.parse(answer, parsing_timeout=None)
    return float(math_verify.verify(gold, math_verify.parse(text, parsing_timeout=None),
                                    timeout_seconds=None))


def grader(task):
    return grade_number if task == "arithmetic" else grade_math


def safely(grade, text, answer):  # -> (reward, failed)
    try:
        return float(grade(text, answer)), False
    except Exception:
        return 0.0, True


def is_flat(group):  # every completion got the same reward: no signal for GRPO
    rewards = [c["reward"] for c in group["completions"]]
    return max(rewards) == min(rewards)


def _grade_forever(conn, grade):  # one grader process: [(text, answer)] in, (reward, failed) out
    for sig in (signal.SIGINT, signal.SIGTERM):  # torchrun signals the group: the engine ends us
        signal.signal(sig, signal.SIG_IGN)
    ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the engine
    while True:
        try:
            jobs = conn.recv()
        except EOFError:  # the engine is gone
            return
        for job in jobs:  # one reply per answer: the engine times each answer
            conn.send(safely(grade, *job))


class Graders:
    """`workers` grader processes. submit() queues an answer; poll() sends each idle worker its
    share of the queue in one message and -> [(key, reward, failed)] done since. An answer's clock
    starts when its worker reaches it: its batch is sent, or the answer before it comes back."""

    def __init__(self, grade, workers=2, timeout_s=5.0):
        self.grade, self.timeout_s = grade, timeout_s
        self.ctx = multiprocessing.get_context("spawn")  # the engine's process has threads: no fork
        self.queue = deque()  # (key, text, answer) not sent yet
        self.pool = [self.start() for _ in range(workers)]

    def start(self):
        conn, theirs = self.ctx.Pipe()
        proc = self.ctx.Process(target=_grade_forever, args=(theirs, self.grade), daemon=True)
        proc.start()
        return {"proc": proc, "conn": conn, "jobs": deque(), "since": 0.0}  # jobs: sent, ungraded

    @property
    def busy(self):
        return bool(self.queue) or any(w["jobs"] for w in self.pool)

    def submit(self, key, text, answer):
        self.queue.append((key, text, answer))

    def wait(self, timeout):  # until a grade comes back, at most timeout seconds
        conns = [w["conn"] for w in self.pool if w["jobs"]]
        if conns:
            multiprocessing.connection.wait(conns, timeout)

    def poll(self):
        done, now = [], time.monotonic()
        for n, w in enumerate(self.pool):
            try:
                while w["jobs"] and w["conn"].poll():
                    done.append((w["jobs"].popleft()[0], *w["conn"].recv()))
                    w["since"] = now
            except (EOFError, OSError):  # it died: the answer it was on fails, like a stuck one
                w["since"] = -self.timeout_s
            if w["jobs"] and now - w["since"] > self.timeout_s:
                w["proc"].kill()
                w["proc"].join()
                done.append((w["jobs"].popleft()[0], 0.0, True))
                self.queue.extendleft(reversed(w["jobs"]))  # the rest of its batch, first again
                self.pool[n] = self.start()
        idle = [w for w in self.pool if not w["jobs"]]
        for k, w in enumerate(idle):  # an even share each: the queue is spread over the pool
            share = -(-len(self.queue) // (len(idle) - k))
            if not share:
                break
            w["jobs"].extend(self.queue.popleft() for _ in range(share))
            w["since"] = now
            with suppress(OSError):  # it died idle: the next poll replaces it
                w["conn"].send([job[1:] for job in w["jobs"]])
        return done

    def close(self):
        for w in self.pool:
            w["proc"].kill()
