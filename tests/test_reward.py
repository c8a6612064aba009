import json
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
    assert reward.score("17 + 25 is 42", "42")[0] == 1.0
    assert reward.score("42? no, 41", "42")[0] == 0.0
    assert reward.score("2.50", "2.5")[0] == 1.0
    assert reward.score("", "42")[0] == 0.0


def test_a_raising_or_hanging_grader_scores_zero():
    def boom(text, answer):
        raise ZeroDivisionError

    def hang(text, answer):
        time.sleep(30)
        return 1.0
    assert reward.score("42", "42", grader=boom) == (0.0, True)
    t0 = time.time()
    assert reward.score("42", "42", timeout_s=0.2, grader=hang) == (0.0, True)
    assert time.time() - t0 < 2
    assert reward.score("42", "42", grader=lambda t, a: 1) == (1.0, False)


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
    train, test = reward.gsm8k(str(path), "", seed=0, n_eval=3)
    assert len(train) == 7 and len(test) == 3
    assert {p["prompt"] for p in train}.isdisjoint({p["prompt"] for p in test})
    assert all(p["answer"] == p["prompt"][1:] for p in train + test)
    path.write_text(json.dumps(rows[0]) + "\n" + '{"question": "no answer"}\n')
    with pytest.raises(ValueError, match="train.jsonl:2"):
        reward.gsm8k(str(path), "", seed=0, n_eval=1)
