"""
reward.py: the tasks (prompts with a reference answer) and their graders.

A task is a pair of lists of problems, train and held-out eval, each problem a dict {"id", "prompt", "answer"}.
  arithmetic  "What is a + b?" generated offline from the seed; the eval pairs are drawn first and never used for
              training. Graded by the last number in the completion.
  gsm8k       a local jsonl file with {"question", "answer"} lines (GSM8K's "#### 42" answer format is understood), or
              a Hugging Face dataset id when the machine is online. Graded with math-verify when it is installed,
              else by the \\boxed{} content or the last number.
Rewards are 1.0 (correct) or 0.0. score() never raises and never hangs: an exception or a grader running past
`timeout_s` scores 0 and is reported so the caller can count it.

Simplifications: exact numeric match only (no partial credit, no format reward); the prompt asks for the answer in
plain words and the tokenizer's chat template (if it has one) wraps it.
"""
import json
import os
import random
import re
import signal
import threading

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def arithmetic(seed, n_eval, max_operand=30):
    rng = random.Random(seed)
    pairs = [(a, b) for a in range(1, max_operand + 1) for b in range(1, max_operand + 1)]
    rng.shuffle(pairs)
    if n_eval >= len(pairs):
        raise ValueError(f"eval_n={n_eval} leaves no training problems (only {len(pairs)} pairs): lower eval_n")
    make = lambda i, ab: {"id": i, "prompt": f"What is {ab[0]} + {ab[1]}?", "answer": str(ab[0] + ab[1])}
    return [make(i, ab) for i, ab in enumerate(pairs[n_eval:])], [make(i, ab) for i, ab in enumerate(pairs[:n_eval])]


def read_jsonl(path):
    rows = []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                rows.append({"prompt": row["question"], "answer": str(row["answer"]).split("####")[-1].strip()})
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{line_no}: expected a JSON object with 'question' and 'answer' ({e!r})")
    return rows


def gsm8k(data_path, eval_path, seed, n_eval):
    for key, path in (("data_path", data_path), ("eval_path", eval_path)):
        if path and (path.endswith((".jsonl", ".json")) or os.sep in path) and not os.path.isfile(path):
            raise ValueError(f"{key} {path!r} not found: point --{key}= at a jsonl file of {{question, answer}} lines")
    if not data_path:
        raise ValueError("task 'gsm8k' needs --data_path=FILE.jsonl (or a hub dataset id where the machine is online)")
    if os.path.isfile(data_path):
        train = read_jsonl(data_path)
        test = read_jsonl(eval_path) if eval_path else None
    else:  # a hub dataset id (openai/gsm8k): where the hub is reachable, or already in the datasets cache
        try:
            import datasets
            ds = datasets.load_dataset(data_path, "main")
        except Exception as e:
            raise ValueError(f"data_path {data_path!r} is not a file and could not be loaded from the Hugging Face "
                             f"hub ({type(e).__name__}: {str(e)[:150]}). Offline? Point --data_path= at a jsonl file "
                             "of {question, answer} lines, or run once where the hub is reachable (`pip install "
                             "datasets`) to fill the cache") from None
        to_rows = lambda split: [{"prompt": r["question"], "answer": r["answer"].split("####")[-1].strip()} for r in split]
        train, test = to_rows(ds["train"]), to_rows(ds["test"])
    if test is None:  # no eval file: hold out the last n_eval problems of a seeded shuffle
        random.Random(seed).shuffle(train)
        train, test = train[:-n_eval], train[-n_eval:]
    number = lambda rows: [dict(r, id=i) for i, r in enumerate(rows)]
    return number(train), number(test[:n_eval])


def load_task(cfg):
    if cfg["task"] == "arithmetic":
        return arithmetic(cfg["seed"], cfg["eval_n"])
    if cfg["task"] == "gsm8k":
        return gsm8k(cfg["data_path"], cfg["eval_path"], cfg["seed"], cfg["eval_n"])
    raise ValueError(f"unknown task {cfg['task']!r}: use 'arithmetic' or 'gsm8k'")


def extract_answer(text):
    """The \\boxed{...} content if there is one, else the last number; None if neither."""
    boxed = re.findall(r"\\boxed\{([^{}]*)\}", text)
    if boxed:
        text = boxed[-1]
    nums = NUMBER.findall(text)
    return nums[-1].replace(",", "").rstrip(".") if nums else None


def _numeric_equal(pred, answer):
    try:
        return abs(float(pred) - float(answer.replace(",", ""))) < 1e-6
    except ValueError:
        return pred.strip() == answer.strip()


def grade(text, answer):
    try:
        import math_verify
        return float(math_verify.verify(math_verify.parse(answer), math_verify.parse(text)))
    except ImportError:
        pred = extract_answer(text)
        return float(pred is not None and _numeric_equal(pred, answer))


class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout()


def score(text, answer, timeout_s=5.0, grader=grade):
    """-> (reward, failed). Never raises. The time limit uses SIGALRM, so it applies in the main thread only."""
    use_alarm = timeout_s > 0 and threading.current_thread() is threading.main_thread()
    try:
        if use_alarm:
            old = signal.signal(signal.SIGALRM, _alarm)
            signal.setitimer(signal.ITIMER_REAL, timeout_s)
        return float(grader(text, answer)), False
    except BaseException as e:  # a grader bug, a timeout, anything: the sample scores 0, the run goes on
        if isinstance(e, KeyboardInterrupt):
            raise
        return 0.0, True
    finally:
        if use_alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
