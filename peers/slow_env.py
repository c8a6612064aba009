"""bench.py --env: the calculator environment with every step ENV_STEP_S slower (default 50 ms),
as a remote sandbox or a tool behind a network would be."""
import os
import time

from envs.calculator import Calculator  # the repository is on the engines' path


class SlowCalculator(Calculator):
    def step(self, text):
        time.sleep(float(os.environ.get("ENV_STEP_S", "0.05")))
        return super().step(text)
