"""configurator.py: config files (config/*.py), then --key=value, override train.py's defaults,
types kept; check() validates the rest. A mistake stops, saying why.

Runs in every trainer rank at start-up, before any process group, model or engine exists, so a
mistake costs seconds, not a GPU allocation: each error is one `error:` line and exit code 2.
Rank 0 alone looks at the checkpoint and plays the environment once: other nodes need neither."""
import ast, difflib, importlib.util, json, os, runpy, sys

import torch


def die(msg):
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)


def _set(cfg, key, value, origin):
    if key not in cfg:
        near = difflib.get_close_matches(key, cfg, n=1)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        die(f"unknown config key {key!r} in {origin}{hint}")
    want, got = type(cfg[key]), type(value)
    if got is not want and not (want is float and got is int):
        die(f"config key {key!r} in {origin} must be {want.__name__}, got {got.__name__} {value!r}")
    cfg[key] = want(value)  # int -> float


def apply(scope, argv):  # -> train.py's globals, argv applied
    cfg = {k: v for k, v in scope.items() if k[0] != "_" and isinstance(v, (int, float, str))}
    for arg in argv:
        if not arg.startswith("--"):
            if not os.path.isfile(arg):
                die(f"config file {arg!r} not found (see config/)")
            if not arg.endswith(".py"):  # runpy would run a .json as Python
                die(f"config file {arg!r} is not a .py file of bare assignments (see config/)")
            try:
                assigned = runpy.run_path(arg)
            except Exception as e:  # a typo in the file: where, not a traceback
                where = f"{arg}:{e.lineno}" if isinstance(e, SyntaxError) else arg
                die(f"config file {where} does not run: {type(e).__name__}: {e}")
            for key, value in assigned.items():
                if not key.startswith("__"):
                    _set(cfg, key, value, arg)
            continue
        key, eq, text = arg[2:].partition("=")
        want = type(cfg.get(key))
        if not eq and want is not bool:
            die(f"{arg!r} has no value: write --{key}=VALUE")
        try:
            value = ast.literal_eval(text if eq else "True")  # a bare --flag: True
        except (ValueError, SyntaxError):
            value = text  # a string: --model=data/tiny
        if want is str and type(value) is not str:
            value = text  # as written: --rollout_cpus=1
        _set(cfg, key, value, arg)
    scope.update(cfg)
    return cfg


def resolve_model(name):  # -> a local folder, or the hub's copy
    make = "`python prepare.py tiny|smollm2` makes one offline"
    if os.path.isdir(name):
        if not os.path.isfile(f"{name}/config.json"):
            die(f"model folder {name!r} has no config.json ({make})")
        return name
    try:
        from huggingface_hub import snapshot_download
        files = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken"]
        return snapshot_download(name, allow_patterns=files)
    except Exception as e:
        die(f"model {name!r} is no local folder, nor loads from the hub ({type(e).__name__}): "
            f"`hf download {name} --local-dir DIR` elsewhere, then --model=DIR; or {make}")


def check(cfg, world):  # before anything starts -> cfg, model resolved
    import reward
    if cfg["batch_groups"] % world:
        die(f"batch_groups={cfg['batch_groups']}: use a multiple of the {world} trainer ranks")
    if cfg["max_staleness"] < 0:
        die(f"max_staleness={cfg['max_staleness']} must be >= 0 (0 = synchronous)")
    if min(cfg["rollout_engines"], cfg["tensor_parallel_size"], cfg["grader_workers"]) < 1:
        die("rollout_engines, tensor_parallel_size and grader_workers must be >= 1")
    if cfg["temperature"] <= 0:  # the logprobs divide by it; greedy answers have no spread
        die(f"temperature={cfg['temperature']} must be > 0 (evals are greedy already)")
    if cfg["eval_every"] > 0 and cfg["eval_n"] < 1:
        die(f"eval_n={cfg['eval_n']} with eval_every={cfg['eval_every']}: eval_n >= 1, or "
            "--eval_every=0")
    if cfg["rollout_seqs"] < cfg["group_size"]:
        die(f"rollout_seqs={cfg['rollout_seqs']} < group_size={cfg['group_size']}: raise it")
    seqs = (cfg["max_staleness"] + 1) * cfg["batch_groups"] * cfg["group_size"]  # budget.py
    engines = cfg["rollout_engines"] * int(os.environ["GROUP_WORLD_SIZE"])
    if seqs < engines * cfg["rollout_seqs"] and os.environ["RANK"] == "0":
        print(f"warning: (max_staleness + 1) x batch_groups x group_size = {seqs} sequences can't "
              f"fill {engines} engines x rollout_seqs={cfg['rollout_seqs']}: raise one of those, "
              f"or fewer engines or rollout_seqs={seqs // engines}", file=sys.stderr)
    if cfg["tracker"] not in ("", "wandb", "trackio"):
        die(f"unknown tracker {cfg['tracker']!r}: use wandb, trackio or \"\" (none)")
    if cfg["tracker"] and importlib.util.find_spec(cfg["tracker"]) is None:
        die(f"tracker {cfg['tracker']!r} is not installed: pip install {cfg['tracker']}")
    # cfg keeps the model as written: a hub id resolves to another folder on another machine
    resolved = dict(cfg, model=resolve_model(cfg["model"]))
    check_model(resolved)
    try:  # the engines load it too; errors are clearer here
        task = reward.load_task(resolved)
    except (OSError, ValueError, KeyError) as e:
        die(str(e))
    if task["env"] and os.environ["RANK"] == "0":  # played once, as an engine would
        import env
        if why := env.smoke(task["env"], cfg["reward_timeout_s"]):
            die(f"task {cfg['task']!r}: seed 0's reset(), then step(''), failed: {why}")
    if os.environ["RANK"] == "0":  # rank 0 alone reads it: other nodes need no copy
        check_checkpoint(cfg)
    return resolved


def check_model(cfg):
    """The model folder: a causal LM with weights, whose attention the trainer computes as vLLM
    does, and LoRA settings vLLM can serve."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    import lora
    conf = json.load(open(f"{cfg['model']}/config.json"))
    kind, archs = conf.get("model_type"), conf.get("architectures") or []
    causal = kind in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and (
        not archs or any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs))
    if not causal:
        die(f"{cfg['model']!r} is a {'/'.join(archs) or kind!r}: use a causal (decoder-only) LM")
    if cfg["lora_rank"] not in (0, 1, 8, 16, 32, 64, 128, 256, 320, 512):  # 0: every weight
        die(f"lora_rank={cfg['lora_rank']} is none of vLLM's: 1, 8, 16, 32, 64, 128, 256, 320, 512")
    if cfg["lora_rank"] and os.environ["RANK"] == "0" and not lora.servable(archs):
        die(f"vLLM has no LoRA for {'/'.join(archs) or kind}: --lora_rank=0 trains every weight")
    # the packed attention (loss.py) is full causal attention, without softcapping or sinks: a
    # model that needs them would train on other logprobs than vLLM samples from (a sliding
    # window longer than any sequence changes nothing)
    window = conf.get("sliding_window") if conf.get("use_sliding_window", True) else None
    if window and window < cfg["max_model_len"] or conf.get("attn_logit_softcapping") or (
            kind == "gpt_oss"):
        die(f"{kind!r} uses sliding windows, softcapping or attention sinks, which the packed "
            "attention (loss.py) does not implement: another model, or for a window "
            f"--max_model_len={window or 0} or less")
    if cfg["lora_rank"] and cfg["rollout_dtype"] == "float32" and torch.cuda.is_available():
        die("lora_rank > 0 on a GPU needs --rollout_dtype=bfloat16 (or float16): vLLM's LoRA "
            "kernels take no float32")
    if not any(f.endswith((".safetensors", ".bin")) for f in os.listdir(cfg["model"])):
        die(f"model folder {cfg['model']!r} has no weights (*.safetensors): an interrupted "
            "download? fetch it again (`python prepare.py tiny|smollm2` makes one offline)")


# what a resumed run must share with its checkpoint: they shape the prompt stream or the weights
SHAPING = "model task data_path seed eval_n lora_rank lora_alpha lora_targets".split()


def check_checkpoint(cfg):
    """A checkpoint in out_dir is never overwritten by a fresh run (a re-run command, a requeued
    job): --resume continues it. Resuming, the checkpoint's config must agree on SHAPING."""
    path = f"{cfg['out_dir']}/ckpt.pt"
    if not os.path.isfile(path):
        if cfg["resume"]:
            die(f"--resume: no {path} (--ckpt_every=K writes one); drop --resume")
        return
    try:  # memory-mapped: reads the small parts only
        ckpt = torch.load(path, mmap=True, weights_only=True)
    except Exception as e:
        die(f"{path} does not load ({type(e).__name__}: {str(e)[:200]}): another --out_dir")
    if not cfg["resume"]:
        die(f"{cfg['out_dir']} has a checkpoint at version {ckpt['version']}: --resume to "
            "continue, or another --out_dir")
    saved = ckpt.get("config", {})  # none before checkpoints kept it
    differ = [k for k in SHAPING if k in saved and saved[k] != cfg[k]]
    if differ:
        die(f"--resume: {path} was made with " + ", ".join(
            f"{k}={saved[k]!r}" for k in differ) + " (now " + ", ".join(
            f"{cfg[k]!r}" for k in differ) + "): resume with those, or another --out_dir")
