"""configurator.py: config files (config/*.py), then --key=value, override train.py's defaults,
types kept; check() validates the rest. A mistake stops, saying why."""
import ast
import difflib
import importlib.util
import json
import os
import runpy
import sys


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
            for key, value in runpy.run_path(arg).items():
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
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    import lora
    import reward
    if cfg["batch_groups"] % world:
        die(f"batch_groups={cfg['batch_groups']}: use a multiple of the {world} trainer ranks")
    if cfg["max_staleness"] < 0:
        die(f"max_staleness={cfg['max_staleness']} must be >= 0 (0 = synchronous)")
    if min(cfg["rollout_engines"], cfg["tensor_parallel_size"], cfg["grader_workers"]) < 1:
        die("rollout_engines, tensor_parallel_size and grader_workers must be >= 1")
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
    cfg = dict(cfg, model=resolve_model(cfg["model"]))
    conf = json.load(open(f"{cfg['model']}/config.json"))
    kind, archs = conf.get("model_type"), conf.get("architectures") or []
    causal = kind in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and (
        not archs or any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs))
    if not causal:
        die(f"{cfg['model']!r} is a {'/'.join(archs) or kind!r}: use a causal (decoder-only) LM")
    if cfg["lora_rank"] not in (0, 1, 8, 16, 32, 64, 128, 256, 320, 512):  # 0: every weight
        die(f"lora_rank={cfg['lora_rank']} is none of vLLM's: 1, 8, 16, 32, 64, 128, 256, 320, 512")
    if cfg["lora_rank"] and not lora.servable(archs):
        die(f"vLLM has no LoRA for {'/'.join(archs) or kind}: --lora_rank=0 trains every weight")
    try:  # the engines load it too; errors are clearer here
        reward.load_task(cfg)
    except (OSError, ValueError, KeyError) as e:
        die(str(e))
    if cfg["resume"] and not os.path.isfile(f"{cfg['out_dir']}/ckpt.pt"):
        die(f"--resume: no {cfg['out_dir']}/ckpt.pt (--ckpt_every=K writes one); drop --resume")
    return cfg
