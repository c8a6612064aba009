"""TRL's GRPOTrainer on the CPU demo's task and model, bench.py --trl's baseline: 16 prompts x 8
samples of at most 64 tokens per step, fp32, lr 2e-5, beta 0, constant lr. Needs `pip install trl
datasets`. Prints {"trl_step_s", "rewards", "lengths"}.
Usage: python peers/trl_grpo.py MODEL_DIR OUT_DIR STEPS"""
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import datasets  # noqa: E402
from transformers import TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

import reward  # noqa: E402

model, out, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
train_set, _ = reward.arithmetic(1337, 200)
ds = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": p["prompt"]}],
                                  "answer": p["answer"]} for p in train_set])


def grade(completions, answer, **kw):
    return [reward.grade_number(c[0]["content"], a) for c, a in zip(completions, answer)]


times = []


class Clock(TrainerCallback):
    def on_step_end(self, *a, **kw):
        times.append(time.perf_counter())


cfg = GRPOConfig(output_dir=out, per_device_train_batch_size=16, gradient_accumulation_steps=8,
                 num_generations=8, max_completion_length=64, temperature=0.7, learning_rate=2e-5,
                 beta=0.0, max_steps=steps, logging_steps=1, report_to="none", use_cpu=True,
                 bf16=False, save_strategy="no", seed=1337, lr_scheduler_type="constant")
trainer = GRPOTrainer(model=model, reward_funcs=grade, args=cfg, train_dataset=ds,
                      callbacks=[Clock()])
t0 = time.perf_counter()
trainer.train()
logs = [h for h in trainer.state.log_history if "reward" in h]
print(json.dumps({"trl_step_s": [b - a for a, b in zip([t0] + times, times)],
                  "rewards": [h["reward"] for h in logs],
                  "lengths": [h["completions/mean_length"] for h in logs]}))
