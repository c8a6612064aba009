"""Guess the number: a game won by using the environment's replies.

A secret in 1..N (from the seed), N = 3; K = 2 guesses. After a wrong guess the environment says
whether the secret is higher or lower, and which numbers are still possible. Guessing 2, then
the number left, always wins. A player without that information wins at most K/N = 2/3 of the
games (K distinct guesses among N numbers). Small on purpose: a 135M model on 2 CPU cores has
about twenty steps to learn it; N and K are the knobs for a larger model.

GuessNumberBlind is the control arm: the same game and prompt, every wrong guess answered
"Wrong." with the numbers not yet guessed, which any player knows. A model trained against it
can learn the format and to guess distinct numbers, nothing more; whatever the informative arm
wins beyond that, it learned from the replies.

    torchrun --nproc_per_node=1 train.py config/smollm_guess.py
    torchrun --nproc_per_node=1 train.py config/smollm_guess.py \\
        --task=env:envs/guess.py:GuessNumberBlind --out_dir=out/smollm_guess_blind
"""
import random
import re

N, K = 3, 2
RULES = ("I am thinking of a whole number from 1 to {n}. You have {k} guesses. After each wrong "
         "guess I will tell you if my number is higher or lower, and which numbers are left. "
         "Reply with one number only.")


class GuessNumber:
    def __init__(self, seed):
        self.secret = random.Random(seed).randint(1, N)
        self.left = K
        self.possible = list(range(1, N + 1))

    def reset(self):  # the same for every seed: only the replies tell secrets apart
        """A worked game on 1..9 shows the format (one number a turn) and what a reply means; a
        135M model asked without one writes paragraphs about strategy instead of guessing."""
        return [{"role": "user", "content": "Let's play. " + RULES.format(n=9, k=4)},
                {"role": "assistant", "content": "5"},
                {"role": "user", "content": "Lower. Numbers left: 1, 2, 3, 4."},
                {"role": "assistant", "content": "2"},
                {"role": "user", "content": "Higher. Numbers left: 3, 4."},
                {"role": "assistant", "content": "3"},
                {"role": "user", "content": "Correct! A new game. " + RULES.format(n=N, k=K)}]

    def hint(self, guess):  # -> the reply's first word; self.possible narrowed by it
        higher = self.secret > guess
        self.possible = [n for n in self.possible if (n > guess if higher else n < guess)]
        return "Higher" if higher else "Lower"

    def step(self, text):  # the last number in the turn is the guess
        guesses = re.findall(r"\d+", text)
        self.left -= 1
        if guesses and int(guesses[-1]) == self.secret:
            return None, 1.0, True
        if not self.left:
            return None, 0.0, True
        if not guesses:
            return f"Reply with a number from 1 to {N}.", 0.0, False
        word = self.hint(int(guesses[-1]))
        return f"{word}. Numbers left: {', '.join(map(str, self.possible))}.", 0.0, False


class GuessNumberBlind(GuessNumber):
    def hint(self, guess):  # only what any player knows: that guess was wrong
        self.possible = [n for n in self.possible if n != guess]
        return "Wrong"
