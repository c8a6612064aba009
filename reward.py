"""reward.py: tasks (load_task: train/eval problems {"id", "prompt", "answer"}, grade(text, answer)
-> reward, maybe turn(text, answer) -> tool words or None), run in processes killed past a time
limit. Simplifications: reward 1 or 0 (rg: its scorer's); text-only tools."""
import ast
import concurrent.futures
import ctypes
import functools
import json
import multiprocessing
import operator
import os
import random
import re
import signal

JSONL_HINT = "a jsonl file of {question, answer} lines"
BOXED = "Please reason step by step, and put your final answer within \\boxed{}."  # gsm8k's ask


def problems(rows, instruction=""):  # {"question", "answer"} rows ("... #### 42" -> 42)
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


def gsm8k(data_path, seed, n_eval, instruction=BOXED):  # a jsonl, or a hub id (its test held)
    if data_path.endswith(".jsonl") and not os.path.isfile(data_path):  # a hub id has a "/" too
        raise ValueError(f"data_path {data_path!r} not found: point --data_path= at {JSONL_HINT}")
    if not data_path:
        raise ValueError("task 'gsm8k' needs --data_path=FILE.jsonl (or a hub dataset id, online)")
    if os.path.isfile(data_path):
        train = read_jsonl(data_path)
        random.Random(seed).shuffle(train)
        train, test = train[:-n_eval], train[-n_eval:]
    else:
        try:
            import datasets
            ds = datasets.load_dataset(data_path, "main")
        except Exception as e:
            raise ValueError(f"data_path {data_path!r} is not a file nor a hub dataset that loads "
                             f"({type(e).__name__}: {str(e)[:150]}); offline? point --data_path= "
                             f"at {JSONL_HINT}") from None
        train, test = list(ds["train"]), list(ds["test"])
    return problems(train, instruction), problems(test[:n_eval], instruction)


CALL = ("<calc>", "</calc>")  # a turn ending in <calc>12 * 34</calc> calls it
WORDS = ["Each of {a} boxes holds {b} pens. How many pens are there?",
         "A train travels {b} km every hour for {a} hours. How far does it go?",
         "A farm has {a} rows of {b} trees. How many trees are there?",
         "A printer prints {b} pages a minute for {a} minutes. How many pages does it print?"]
SHOT = ("A farm has 125 cows and buys 37 more. How many cows does it have?", "125 + 37", 162)


def calculator(seed, n_eval, tool=True, n=5000):  # products too big for one's head
    q, expr, value = SHOT
    shown = f"{CALL[0]}{expr}{CALL[1]}<result>{value}</result>" if tool else f"{expr} = {value}."
    chat = [{"role": "user", "content": q},
            {"role": "assistant", "content": f"{shown} The answer is {value}."}]
    rng, rows = random.Random(seed), []
    for i in range(n):
        text, a, b = rng.choice(WORDS), rng.randint(1000, 9999), rng.randint(12, 999)
        rows.append({"id": i, "prompt": chat + [{"role": "user", "content": text.format(a=a, b=b)}],
                     "answer": str(a * b)})
    return rows[n_eval:], rows[:n_eval]


OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
       ast.Div: operator.truediv, ast.USub: operator.neg}


def calculate(node):  # + - * / and brackets, walking the AST (no eval)
    if isinstance(node, str):
        node = ast.parse(node.replace(",", "").replace("x", "*").strip(" ="), mode="eval").body
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, (ast.BinOp, ast.UnaryOp)) and type(node.op) in OPS:
        args = (node.left, node.right) if isinstance(node, ast.BinOp) else (node.operand,)
        return OPS[type(node.op)](*map(calculate, args))
    raise ValueError(f"not arithmetic: {type(node).__name__}")


def calculator_turn(text, answer):  # after a turn ending in a call: <result>value</result>
    if not text.endswith(CALL[1]):
        return None
    try:
        v = calculate(text[:-len(CALL[1])].rpartition(CALL[0])[2])
        v = int(v) if v == int(v) else round(v, 6)
    except (ValueError, ArithmeticError, SyntaxError, TypeError, RecursionError):
        v = "error"  # the model sees it, may call again
    return f"<result>{v}</result>"


def grade_calculator(text, answer):  # the number after the last result
    return grade_number(text.rpartition("</result>")[2], answer)


def reasoning_gym(name, seed, n_eval, n=5000):
    """Problem k from seed + k: train, held-out, the worked example (without one a small model
    ignores <answer> tags) from disjoint seeds."""
    try:
        import reasoning_gym as rg
    except ImportError:
        raise ValueError(f"task 'rg:{name}' needs reasoning-gym: pip install reasoning-gym==0.1.25")
    make = lambda first, size: list(rg.create_dataset(name, seed=first, size=size))
    [shot], test = make(seed - 1, 1), make(seed + n, n_eval)
    held = {e["question"] for e in test}  # a small problem space repeats questions
    ask = [{"role": "system", "content": rg.utils.SYSTEM_PROMPTS["default"]},
           {"role": "user", "content": shot["question"]},
           {"role": "assistant", "content": f"<answer>{shot['answer']}</answer>"}]
    train = [e for e in make(seed, n) if e["question"] not in held]
    posed = lambda es: [{"id": i, "prompt": ask + [{"role": "user", "content": e["question"]}],
                         "answer": e} for i, e in enumerate(es)]  # its scorer needs the whole entry
    return posed(train), posed(test)


@functools.cache
def rg_scorer(name):  # once per grader process
    import reasoning_gym
    return reasoning_gym.get_score_answer_fn(name)


def grade_rg(name, text, entry):  # its own scorer, on the last <answer> tags
    from reasoning_gym.utils import extract_answer
    return rg_scorer(name)(extract_answer(text), entry)


def load_task(cfg):  # stop: text ending a turn that calls the tool (vLLM stops; turn runs)
    turn = stop = None
    if cfg["task"] == "arithmetic":
        (train, test), grade = arithmetic(cfg["seed"], cfg["eval_n"]), grade_number
    elif cfg["task"] == "gsm8k":
        (train, test), grade = gsm8k(cfg["data_path"], cfg["seed"], cfg["eval_n"]), grade_math
    elif cfg["task"] == "calculator":  # max_turns=1: no calculator
        tool = cfg["max_turns"] > 1
        (train, test), grade = calculator(cfg["seed"], cfg["eval_n"], tool), grade_calculator
        turn, stop = (calculator_turn, CALL[1]) if tool else (None, None)
    elif cfg["task"].startswith("rg:"):  # an answer is its reasoning-gym entry
        train, test = reasoning_gym(cfg["task"][3:], cfg["seed"], cfg["eval_n"])
        grade = functools.partial(grade_rg, cfg["task"][3:])
    else:
        raise ValueError(f"unknown task {cfg['task']!r}: use arithmetic, gsm8k, calculator, rg:X")
    return {"train": train, "eval": test, "grade": grade, "turn": turn, "stop": stop}


def extract_answer(text):  # last number in the last \boxed{...} (or the text), or None
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
    import math_verify  # its SIGALRM timers off: Workers kill at the time limit
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout is disabled": it is ours
    gold = math_verify.parse(answer, parsing_timeout=None)
    return float(math_verify.verify(
        gold, math_verify.parse(text, parsing_timeout=None), timeout_seconds=None))


def safely(fn, text, answer):  # -> (grade's float, tool's text or None; failed)
    try:
        out = fn(text, answer)
        if isinstance(out, str) and len(out) > 10_000:  # tool words: more never fit
            return None, True
        return (out if out is None or isinstance(out, str) else float(out)), False
    except Exception:
        return None, True


def is_flat(group):  # all rewards equal: no signal for GRPO
    return len({c["reward"] for c in group["completions"]}) == 1


def die_with_parent(ignored=(signal.SIGINT, signal.SIGTERM)):  # and not by these signals
    for sig in ignored:  # torchrun signals the whole process group
        signal.signal(sig, signal.SIG_IGN)
    ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class Workers:
    """pebble's processes run fn(text, answer) (fn a module's), each killed past timeout_s with its
    process; poll() -> [(key, result, failed)]."""

    def __init__(self, workers=2, timeout_s=5.0):
        import pebble  # its workers ignore SIGINT, exit on SIGTERM: kills take no wait
        self.timeout_s = timeout_s
        self.pool = pebble.ProcessPool(  # spawned: the engine has threads
            workers, initializer=die_with_parent, initargs=((),),
            context=multiprocessing.get_context("spawn"))
        self.running = {}  # future -> key

    def submit(self, key, fn, text, answer):
        future = self.pool.schedule(safely, (fn, text, answer), timeout=self.timeout_s)
        self.running[future] = key

    def wait(self, timeout):  # until a result, or timeout seconds
        concurrent.futures.wait(self.running, timeout, concurrent.futures.FIRST_COMPLETED)

    def poll(self):
        done = []
        for future in [f for f in self.running if f.done()]:
            ok = future.exception() is None  # else killed at the limit, or its process died
            done.append((self.running.pop(future), *(future.result() if ok else (None, True))))
        return done

    def close(self):  # joined: no leaked-semaphore warning
        self.pool.stop()
        self.pool.join()
