"""Environments for the tiny model (task = "env:tests/toy_envs.py:CLASS"). The random model's turn
ends where its text reaches STOP ("1"): in about 1 token of 80; each reply is
appended to its message (a tool call's result)."""
import os
import time

STOP = "1"


class Counter:
    """State across turns: a reply says how many steps this object took, " <k>", so an answer's
    replies read <reply 1>, <reply 2> in order exactly when its own object served all its turns.
    With
    TOOL_MISBEHAVES set, by the turn's length, some steps raise and some hang."""
    stop = STOP

    def __init__(self, seed):
        self.seed, self.steps = seed, 0

    def reset(self):
        return f"What is {self.seed} + 1?"

    def step(self, text):
        self.steps += 1
        if os.environ.get("TOOL_MISBEHAVES") and text and len(text) % 11 < 2:
            [lambda: 1 / 0, lambda: time.sleep(60)][len(text) % 11]()
        if not text.endswith(STOP):
            return None, float(self.steps > 1), True  # a reward for having used a reply
        return f" <reply {self.steps}>", 0.0, False


class GymCounter(Counter):
    """The same in gymnasium's shapes: reset() -> (obs, info), step() -> a 5-tuple."""

    def reset(self):
        return super().reset(), {}

    def step(self, text):
        obs, reward, done = super().step(text)
        return obs, reward, done, False, {}


class Broken(Counter):  # passes the start-up check (its step("") works), fails on real turns
    def step(self, text):
        if text:
            raise RuntimeError("broken on purpose")
        return super().step(text)


class WrongShape(Counter):
    def step(self, text):
        return 1, 2


class NotText(Counter):
    def step(self, text):
        return 5, 0.0, False


class NoStep:
    def __init__(self, seed):
        pass

    def reset(self):
        return "hi"
