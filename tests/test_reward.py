import json
import re
import time

import pytest

import reward


@pytest.mark.parametrize("text, want", [
    ("17 + 25 = 42", "42"),
    ("The answer is 1,234.", "1234"),
    ("so x = \\boxed{7} and 9 others", "7"),
    ("-3 degrees", "-3"),
    ("no digits here", None),
    ("2.50 dollars", "2.50"),
])
def test_extract_answer(text, want):
    assert reward.extract_answer(text) == want


def test_grade_takes_the_final_number():
    assert reward.grade_number("17 + 25 is 42", "42") == 1.0
    assert reward.grade_number("42? no, 41", "42") == 0.0
    assert reward.grade_number("2.50", "2.5") == 1.0
    assert reward.grade_number("", "42") == 0.0


def test_math_verify_grades_boxed_answers():
    assert reward.grade_math("so she pays 3 * 4 = 12 dollars. \\boxed{12}", "12") == 1.0
    assert reward.grade_math("\\boxed{\\frac{1}{2}}", "0.5") == 1.0
    assert reward.grade_math("\\boxed{13}", "12") == 0.0


def boom(text, answer):
    raise ZeroDivisionError


def sleepy(text, answer):
    time.sleep(60)


def grade_all(graders, answers, answer="42", fn=reward.grade_math):
    for i, text in enumerate(answers):
        graders.submit(i, fn, text, answer)
    got = {}
    while len(got) < len(answers):
        got.update({k: (r, failed) for k, r, failed in graders.poll()})
        time.sleep(0.01)
    return [got[i] for i in range(len(answers))]


PATHOLOGICAL = ["\\boxed{9^{9^{9^{9^{9}}}}}",  # a power tower sympy would try to evaluate
                "\\boxed{" + "\\frac{1}{" * 300 + "2" + "}" * 300 + "}",  # deeply nested LaTeX
                # 10k characters of garbage
                "".join(chr(33 + (i * 7919) % 90) for i in range(10_000)),
                "1" * 5000 + " = \\boxed{42}"]  # a huge number, then the right answer


def test_pathological_answers_are_graded_within_the_time_limit():
    """math-verify's own timers are off; a grade past the limit is killed with its process and
    scores 0, and the replacement process grades the next answers."""
    graders = reward.Workers(workers=2, timeout_s=3.0)
    t0 = time.time()
    got = grade_all(graders, PATHOLOGICAL + ["\\boxed{42}"])
    elapsed = time.time() - t0
    graders.close()
    assert got[0] == (None, True)  # the power tower timed out
    assert got[-1] == (1.0, False)  # graded after the killed ones, by a fresh process
    assert all(r in (None, 0.0, 1.0) for r, _ in got)
    assert elapsed < 3.0 * len(got) / 2 + 10  # two processes, each answer at most the limit


def flood(text, answer):
    return "1" * 2**20


def words(text, answer):
    return "<result>42</result>"


def test_a_raising_hanging_or_flooding_call_fails_and_is_counted():
    """A grade that raises, runs past the limit (killed with its process) or returns no finite
    number (a megabyte of digits, words) fails, never a crash or a hang; the next is served."""
    graders = reward.Workers(workers=1, timeout_s=1.0)
    assert grade_all(graders, ["42"], fn=boom) == [(None, True)]
    assert grade_all(graders, ["42"], fn=flood) == [(None, True)]
    assert grade_all(graders, ["42"], fn=words) == [(None, True)]  # no number: no grade
    graders.close()
    graders = reward.Workers(workers=2, timeout_s=0.5)
    t0 = time.time()
    assert grade_all(graders, ["42"] * 4, fn=sleepy) == [(None, True)] * 4
    assert time.time() - t0 < 10
    graders.close()


def test_graders_take_many_answers_per_round_without_spinning():
    """1,000 answers at once, collected by a loop that stands in for the engine's (a 10 ms step,
    then Workers.wait and poll): the workers take the next answer as they finish one, not as the
    loop polls, so a round collects many grades. The loop never spins on an empty poll."""
    graders = reward.Workers(workers=2, timeout_s=5.0)
    for i in range(1000):
        graders.submit(i, reward.grade_number, f"{i} + 1 = {i + 1}", str(i + 1))
    got, rounds, empty = {}, 0, 0
    while len(got) < 1000:
        time.sleep(0.01)
        graders.wait(1.0)
        done = graders.poll()
        got.update({k: (r, failed) for k, r, failed in done})
        rounds, empty = rounds + 1, empty + (not done)
    assert not graders.running
    graders.close()
    assert all(got[i] == (1.0, False) for i in range(1000))
    assert rounds < 100 and empty <= 2, (rounds, empty)  # one answer per worker a round: 500


def test_arithmetic_keeps_eval_out_of_training():
    train, test = reward.arithmetic(seed=0, n_eval=100)
    assert len(test) == 100 and len(train) == 800
    assert not {p["prompt"] for p in train} & {p["prompt"] for p in test}
    assert train == reward.arithmetic(seed=0, n_eval=100)[0]  # reproducible from the seed
    p = test[0]
    a, b = map(int, p["prompt"].removeprefix("What is ").removesuffix("?").split(" + "))
    assert p["answer"] == str(a + b)


def test_gsm8k_jsonl(tmp_path):
    rows = [{"question": f"q{i}", "answer": f"work...\n#### {i}"} for i in range(10)]
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    train, test = reward.gsm8k(str(path), seed=0, n_eval=3, instruction="")
    assert len(train) == 7 and len(test) == 3
    assert {p["prompt"] for p in train}.isdisjoint({p["prompt"] for p in test})
    assert all(p["answer"] == p["prompt"][1:] for p in train + test)
    path.write_text(json.dumps(rows[0]) + "\n" + '{"question": "no answer"}\n')
    with pytest.raises(ValueError, match="train.jsonl:2"):
        reward.gsm8k(str(path), seed=0, n_eval=1)


def test_the_calculator_computes_arithmetic_and_nothing_else():
    from envs.calculator import Calculator, calculate
    assert calculate("9376 * 509") == 4772384
    assert calculate(" 1,000 + 2 = ") == 1002 and calculate("(2 + 3) x 4") == 20
    assert calculate("7 / 2") == 3.5 and calculate("-3 - -4") == 1
    for bad in ("__import__('os').system('true')", "2 ** 99999", "a + 1", "[1] * 9", "1 +"):
        with pytest.raises((ValueError, SyntaxError)):
            calculate(bad)
    env = Calculator(0)
    turn = lambda text: env.step(text)[0]
    assert env.step(f"The answer is {env.answer}.") == (None, 1.0, True)  # no call: graded
    assert env.step("The answer is 42.") == (None, 0.0, True)
    assert turn("so <calc>23 * 45</calc>") == "<result>1035</result>"
    assert turn("<calc>1 / 0</calc>") == "<result>error</result>"
    assert turn("<calc>os</calc>") == "<result>error</result>"
    assert turn("<calc>10 / 4</calc>") == "<result>2.5</result>"


def test_the_calculator_is_an_environment():
    """task = "calculator" is the environment envs/calculator.py: a seed's problem, a call's
    result appended to the model's message, the answer after it graded."""
    cfg = {"task": "calculator", "seed": 0, "eval_n": 50, "max_turns": 3}
    from envs.calculator import Calculator, CalculatorNoTool
    task = reward.load_task(cfg)
    assert task["env"] == f"env:{reward.CALCULATOR}:Calculator" and task["stop"] == "</calc>"
    assert [p["answer"] for p in task["eval"]] == list(range(50))  # held-out seeds
    assert min(p["answer"] for p in task["train"]) >= 50
    env = Calculator(7)
    prompt = env.reset()
    assert prompt[1]["content"].startswith("<calc>") and prompt[-1]["role"] == "user"
    assert prompt == Calculator(7).reset() != Calculator(8).reset()
    a, b = map(int, re.findall(r"\d+", prompt[-1]["content"]))
    assert env.step(f"<calc>{a} * {b}</calc>") == (f"<result>{a * b}</result>", 0.0, False)
    assert env.step(f" The answer is {a * b}.") == (None, 1.0, True)
    assert Calculator(7).step("The answer is 3.") == (None, 0.0, True)
    alone = reward.load_task(dict(cfg, max_turns=1))  # the baseline: no calculator offered
    assert alone["env"].endswith("envs/calculator.py:CalculatorNoTool") and alone["stop"] is None
    assert "<calc>" not in json.dumps(CalculatorNoTool(7).reset())


@pytest.mark.parametrize("name", ["chain_sum", "letter_counting"])
def test_a_reasoning_gym_task_is_graded_by_its_own_scorer(name):
    """Train and held-out problems from disjoint seeds, the same from the same seed; the prompt
    asks for <answer> tags and shows them once; the dataset's scorer reads the last tags, in the
    graders' processes too (the grade and the entry travel by pickle)."""
    import reasoning_gym
    cfg = {"task": f"rg:{name}", "seed": 0, "eval_n": 50, "max_turns": 1}
    task = reward.load_task(cfg)
    train, test = task["train"], task["eval"]
    assert len(test) == 50 and len(train) > 4000 and task["env"] is None
    question = lambda p: p["prompt"][-1]["content"]
    assert not {question(p) for p in train} & {question(p) for p in test}
    assert test == reward.load_task(cfg)["eval"]  # reproducible from the seed
    assert test != reward.load_task(dict(cfg, seed=1))["eval"]
    p = test[0]
    assert [m["role"] for m in p["prompt"]] == ["system", "user", "assistant", "user"]
    assert "<answer>" in p["prompt"][0]["content"]  # the system prompt asks, the example shows
    shot = reasoning_gym.create_dataset(name, seed=-1, size=1)[0]  # seed 0 - 1: its own
    shown = f"<answer>{shot['answer']}</answer>"
    assert p["prompt"][1:3] == [{"role": "user", "content": shot["question"]},
                                {"role": "assistant", "content": shown}]
    assert p["answer"] == reasoning_gym.create_dataset(name, seed=5000, size=1)[0]  # seed 0 + 5000
    right = p["answer"]["answer"]
    wrong = str(int(right) + 1)  # both tasks answer with an integer
    assert task["grade"](f"Adding them up... <answer>{right}</answer>", p["answer"]) == 1.0
    assert task["grade"](f"<answer>{right}</answer> no, <answer>{wrong}</answer>", p["answer"]) == 0
    assert task["grade"](right, p["answer"]) == 0.0  # not in the format the prompt asks for
    graders = reward.Workers(workers=1, timeout_s=30.0)  # the first grade imports reasoning-gym
    got = grade_all(graders, [f"<answer>{right}</answer>", f"<answer>{wrong}</answer>"],
                    answer=p["answer"], fn=task["grade"])
    graders.close()
    assert got == [(1.0, False), (0.0, False)]
