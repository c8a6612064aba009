"""The calculator, as an environment (env.py's protocol): `task = "calculator"` runs it, as does
`task = "env:envs/calculator.py:Calculator"`. Runs where every environment does: in a process of
its own per answer, started by the engine (env.Envs).

A word problem (a 4-digit times a 2-3 digit number), shown one worked call on a sum. A turn ending
in <calc>EXPR</calc> gets <result>VALUE</result>, appended to the model's own message (`stop`:
the call is a tool call, not a user turn); the first turn without a call is the answer, 1 if its
last number is right. CalculatorNoTool: the same problems, no tool offered (with max_turns = 1,
`task = "calculator"` picks it: the baseline). The expression is walked as an AST, never
evaluated as code: the model's text is untrusted."""
import ast
import operator
import random

from reward import grade_number

CALL = ("<calc>", "</calc>")  # a turn ending in <calc>12 * 34</calc> calls it
WORDS = ["Each of {a} boxes holds {b} pens. How many pens are there?",
         "A train travels {b} km every hour for {a} hours. How far does it go?",
         "A farm has {a} rows of {b} trees. How many trees are there?",
         "A printer prints {b} pages a minute for {a} minutes. How many pages does it print?"]
# the worked example: without one, a 135M model never makes a call to learn from
SHOT = ("A farm has 125 cows and buys 37 more. How many cows does it have?", "125 + 37", 162)
OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
       ast.Div: operator.truediv, ast.USub: operator.neg}  # no **: 2 ** 99999 would hang us


def calculate(node):  # + - * / and brackets, walking the AST (no eval)
    if isinstance(node, str):
        node = ast.parse(node.replace(",", "").replace("x", "*").strip(" ="), mode="eval").body
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, (ast.BinOp, ast.UnaryOp)) and type(node.op) in OPS:
        args = (node.left, node.right) if isinstance(node, ast.BinOp) else (node.operand,)
        return OPS[type(node.op)](*map(calculate, args))
    raise ValueError(f"not arithmetic: {type(node).__name__}")


class Calculator:
    stop, tool = CALL[1], True

    def __init__(self, seed):
        rng = random.Random(seed)
        text, a, b = rng.choice(WORDS), rng.randint(1000, 9999), rng.randint(12, 999)
        self.question, self.answer = text.format(a=a, b=b), str(a * b)

    def reset(self):
        q, expr, value = SHOT
        shown = f"{CALL[0]}{expr}{CALL[1]}<result>{value}</result>" if self.tool else (
            f"{expr} = {value}.")
        return [{"role": "user", "content": q},
                {"role": "assistant", "content": f"{shown} The answer is {value}."},
                {"role": "user", "content": self.question}]

    def step(self, text):
        if not (self.tool and text.endswith(CALL[1])):  # no call: the answer, graded
            return None, grade_number(text, self.answer), True
        try:
            v = calculate(text[:-len(CALL[1])].rpartition(CALL[0])[2])
            v = int(v) if v == int(v) else round(v, 6)
        except (ValueError, ArithmeticError, SyntaxError, TypeError, RecursionError):
            v = "error"  # the model sees it, and may call again
        return f"<result>{v}</result>", 0.0, False


class CalculatorNoTool(Calculator):
    stop, tool = None, False
