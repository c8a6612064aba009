"""Guess the number: a game won only by using the environment's replies.

A secret in 1..N (from the seed); K = log2(N + 1) guesses; after each wrong guess the environment
says whether the secret is higher or lower. Binary search always wins. A player that ignores the
replies wins at most K/N of the games (K distinct guesses among N numbers).

GuessNumberBlind is the control arm: the same game, the same prompt, every wrong guess answered
"Wrong.", so its replies carry no information about the secret. A model trained against it can
learn the format and to guess K distinct numbers, nothing more; whatever the informative arm wins
beyond that, it learned from the replies.

    torchrun --nproc_per_node=1 train.py config/smollm_guess.py
    torchrun --nproc_per_node=1 train.py config/smollm_guess.py \\
        --task=env:envs/guess.py:GuessNumberBlind --out_dir=out/smollm_guess_blind
"""
import random
import re

N, K = 7, 3


class GuessNumber:
    def __init__(self, seed):
        self.secret = random.Random(seed).randint(1, N)
        self.left = K

    def reset(self):  # the same for every seed: only the replies tell secrets apart
        """A worked game on 1..3 shows the format (one number a turn) and what a reply means; a
        135M model asked without one writes paragraphs about strategy instead of guessing."""
        rules = ("I am thinking of a whole number from 1 to {n}. You have {k} guesses. After each "
                 "wrong guess I will tell you if my number is higher or lower. Reply with one "
                 "number only.")
        return [{"role": "user", "content": "Let's play. " + rules.format(n=3, k=2)},
                {"role": "assistant", "content": "2"},
                {"role": "user", "content": "Lower. 1 guesses left."},
                {"role": "assistant", "content": "1"},
                {"role": "user", "content": "Correct! A new game. " + rules.format(n=N, k=K)}]

    def hint(self, guess):
        return "Higher." if self.secret > guess else "Lower."

    def step(self, text):  # the last number in the turn is the guess
        guesses = re.findall(r"\d+", text)
        self.left -= 1
        if guesses and int(guesses[-1]) == self.secret:
            return None, 1.0, True
        if not self.left:
            return None, 0.0, True
        reply = self.hint(int(guesses[-1])) if guesses else f"Reply with a number from 1 to {N}."
        return f"{reply} {self.left} guesses left.", 0.0, False


class GuessNumberBlind(GuessNumber):
    def hint(self, guess):
        return "Wrong."
