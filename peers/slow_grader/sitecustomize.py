"""bench.py --grading: every answer takes 50 ms more to grade, in every process of a run that
has this folder on its PYTHONPATH."""
import functools
import time

import reward

slow = reward.grade_number
reward.grade_number = functools.wraps(slow)(
    lambda text, answer: time.sleep(0.05) or slow(text, answer))
