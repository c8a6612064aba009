"""Every answer takes 50 ms to grade: reward.grade_number sleeps 50 ms before it grades,
in every process of the run."""
import functools, time, reward
slow = reward.grade_number
reward.grade_number = functools.wraps(slow)(
    lambda text, answer: time.sleep(0.05) or slow(text, answer))
