"""reward.py: tasks (load_task: train/eval problems {"id", "prompt", "answer"}, grade(text, answer)
-> reward; or an environment, env.py, as the calculator is: envs/calculator.py), graders run in
processes killed past a time limit. Simplifications: reward 1 or 0 (rg: its scorer's); text-only
environments.

Runs in the trainer (load_task, to check the config) and in each engine (load_task, then the
graders it submits to), and the grade functions in the grader processes, which are confined
(confine): the model's text is untrusted input to everything here."""
import concurrent.futures, ctypes, functools, json, math
import multiprocessing, os, random, re, resource, signal

CALCULATOR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "envs", "calculator.py")
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


def read_jsonl(path):  # a bad line is named, with its number
    rows = []
    for n, line in enumerate(open(path, "rb"), 1):
        try:
            if line.strip():
                row = json.loads(line.decode("utf-8"))
                rows.append({"question": row["question"], "answer": row["answer"]})
                if not isinstance(row["question"], str):
                    raise TypeError(f"question is a {type(row['question']).__name__}, not text")
        except (ValueError, KeyError, TypeError) as e:  # UnicodeDecodeError is a ValueError
            raise ValueError(f"{path}:{n}: expected a JSON object (UTF-8) with a text question "
                             f"and an answer ({e!r})") from None
    return rows


def gsm8k(data_path, seed, n_eval, instruction=BOXED):  # a jsonl, or a hub id (its test held)
    if data_path.endswith(".jsonl") and not os.path.isfile(data_path):  # a hub id has a "/" too
        raise ValueError(f"data_path {data_path!r} not found: point --data_path= at {JSONL_HINT}")
    if not data_path:
        raise ValueError("task 'gsm8k' needs --data_path=FILE.jsonl (or a hub dataset id, online)")
    if os.path.isfile(data_path):
        train = read_jsonl(data_path)
        if n_eval >= len(train):
            raise ValueError(f"eval_n={n_eval} leaves none of {data_path}'s {len(train)} rows to "
                             "train on: lower eval_n")
        random.Random(seed).shuffle(train)
        cut = len(train) - n_eval  # (train[:-0] would be empty)
        train, test = train[:cut], train[cut:]
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


# reasoning-gym 0.1.25 scorers that evaluate the model's answer as code (eval, or sympy's
# parse_expr, which calls eval): an answer can run a command, or read the scorer's own variables
# (`oracle_answer`) and score without solving. RL finds such answers.
UNSAFE_RG = ("binary_matrix countdown intermediate_integration n_queens polynomial_multiplication "
             "puzzle24 simple_integration spiral_matrix string_insertion").split()


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


def load_task(cfg):
    """-> {"train", "eval": problems {"id", "prompt", "answer"}, "grade": grade(text, answer),
    "env": None}; or for an environment (env.py) {"train", "eval": problems whose answer is the
    seed, "env": its spec, "stop": text that ends a model turn, or None}."""
    task, stop, spec = cfg["task"], None, None
    if task == "arithmetic":
        (train, test), grade = arithmetic(cfg["seed"], cfg["eval_n"]), grade_number
    elif task == "gsm8k":
        (train, test), grade = gsm8k(cfg["data_path"], cfg["seed"], cfg["eval_n"]), grade_math
    elif task.startswith("rg:"):  # an answer is its reasoning-gym entry
        if task[3:] in UNSAFE_RG and not cfg["unsafe_graders"]:
            raise ValueError(f"task {task!r}: its scorer evaluates the model's text as code "
                             "(an answer could run commands or read the right answer); "
                             "--unsafe_graders=True to run it anyway, in limited processes")
        train, test = reasoning_gym(task[3:], cfg["seed"], cfg["eval_n"])
        grade = functools.partial(grade_rg, task[3:])
    elif task == "calculator" or task.startswith("env:"):  # max_turns=1: no calculator
        import env
        tool = "Calculator" if cfg["max_turns"] > 1 else "CalculatorNoTool"
        spec = f"env:{CALCULATOR}:{tool}" if task == "calculator" else task
        stop = getattr(env.load(spec)[0], "stop", None)
        if not 0 <= cfg["eval_n"] < env.EVAL_SEEDS:
            raise ValueError(f"eval_n={cfg['eval_n']}: held-out seeds are 0..eval_n-1, below "
                             f"{env.EVAL_SEEDS}, the first training seed")
        seeds = lambda first, n: [{"id": i, "prompt": None, "answer": first + i} for i in range(n)]
        train, test, grade = seeds(env.EVAL_SEEDS, 100_000), seeds(0, cfg["eval_n"]), None
    else:
        raise ValueError(f"unknown task {task!r}: use arithmetic, gsm8k, calculator, rg:NAME or "
                         "env:MODULE:CLASS")
    return {"train": train, "eval": test, "grade": grade, "env": spec, "stop": stop}


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
    parse = functools.partial(math_verify.parse, parsing_timeout=None)
    return float(math_verify.verify(parse(answer), parse(text), timeout_seconds=None))


def safely(fn, text, answer):  # -> (the grade, failed): a raise, or no finite number, failed
    try:
        out = float(fn(text, answer))
        return (out, False) if math.isfinite(out) else (None, True)  # a NaN is no grade
    except Exception:
        return None, True


def is_flat(group):  # all rewards equal: no signal for GRPO
    return len({c["reward"] for c in group["completions"]}) == 1


def die_with_parent(ignored=(signal.SIGINT, signal.SIGTERM)):  # and not by these signals
    for sig in ignored:  # torchrun signals the whole process group
        signal.signal(sig, signal.SIG_IGN)
    ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


LIMITS = {"RLIMIT_AS": 8 << 30, "RLIMIT_FSIZE": 64 << 20, "RLIMIT_CORE": 0}  # bytes


def confine():
    """A grader or environment process: it dies with its engine, and may use 8 GiB of address
    space and write files of 64 MiB at most (a runaway answer fails its call, not the machine).
    Processes are not limited: RLIMIT_NPROC counts every thread of the user (a BLAS pool would
    fail) and binds no one running as root."""
    die_with_parent(())
    for name, limit in LIMITS.items():
        soft, hard = resource.getrlimit(getattr(resource, name))
        if hard == resource.RLIM_INFINITY or limit < hard:  # never raise one
            resource.setrlimit(getattr(resource, name), (limit, hard))


def start_grader(grade, answer):
    """A grader process begins: confined, then one untimed grade of an empty answer, so that the
    imports a grader makes at its first call (math-verify's sympy, reasoning-gym: seconds on a
    busy machine) are not counted against reward_timeout_s and fail the first real answers."""
    confine()
    if grade:
        safely(grade, "", answer)


class Workers:
    """pebble's processes run fn(text, answer) (fn a module's), each killed past timeout_s with its
    process; poll() -> [(key, result, failed)]. grade, answer: the warm-up (start_grader)."""

    def __init__(self, workers=2, timeout_s=5.0, grade=None, answer=None):
        import pebble  # its workers ignore SIGINT, exit on SIGTERM: kills take no wait
        self.timeout_s = timeout_s
        self.pool = pebble.ProcessPool(  # spawned: the engine has threads
            workers, initializer=start_grader, initargs=(grade, answer),
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
