# Guess the number (`make guess`): SmolLM2-135M-Instruct (offline, `python prepare.py smollm2`)
# plays envs/guess.py on 2 cores: a secret in 1..3, 2 guesses; after a wrong one, "Higher." or
# "Lower." and the numbers left. --task=env:envs/guess.py:GuessNumberBlind is the control arm: its
# replies carry no information ("Wrong.", the numbers not yet guessed), so it wins at most 2/3 of
# the games however it plays.
model = "data/smollm2-135m"
task = "env:envs/guess.py:GuessNumber"
out_dir = "out/smollm_guess"
max_steps = 10  # both arms reach their ceiling by version 5 (results log)
max_turns = 2  # a guess a turn
batch_groups = 8
group_size = 8
max_new_tokens = 32  # two guesses and a reply take ~15; a paragraph is cut (reward 0)
temperature = 1.0  # guesses vary enough to compare within a group
lr = 3e-5
max_staleness = 1
drop_flat = False  # a won game gives flat groups only: dropping them would stall a solved run
eval_every = 5
eval_n = 100  # seeds 0..99, never trained on; a binomial standard error of ~0.05
rollout_seqs = 128
rollout_dtype = "float32"  # see smollm_cpu.py
trainer_dtype = "float32"
rollout_cpus = "1"
micro_batch_tokens = 1024  # see smollm_cpu.py
max_model_len = 320  # the worked game makes the prompt ~150 tokens
kv_cache_gb = 2
timeout_s = 300
