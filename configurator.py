"""
configurator.py: train.py's config. Config files (bare assignments, config/*.py) and --key=value arguments
override train.py's defaults, in the order given. Only keys train.py defines are accepted, with the type of their
default: a typo or a wrong type stops the run before anything starts, with the fix. check() then validates the
whole config against the machine, also before anything starts.
"""
import ast
import difflib
import json
import os
import sys


def die(msg):
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)


def _typed(defaults, key, value, origin):
    if key not in defaults:
        near = difflib.get_close_matches(key, defaults, n=1)
        die(f"unknown config key {key!r} in {origin}" + (f"; did you mean {near[0]!r}?" if near else ""))
    want = type(defaults[key])
    if want is float and type(value) is int:
        value = float(value)
    if type(value) is not want:
        die(f"config key {key!r} in {origin} must be {want.__name__}, got {type(value).__name__} {value!r}")
    return value


def apply(scope, argv):
    """Override the config keys of `scope` (train.py's globals) from argv; -> the whole config as a dict."""
    defaults = {k: v for k, v in scope.items() if not k.startswith("_") and isinstance(v, (int, float, bool, str))}
    for arg in argv:
        if arg.startswith("--"):
            key, eq, text = arg[2:].partition("=")
            if not eq and isinstance(defaults.get(key), bool):
                text = "True"  # a bare --flag switches a boolean key on
            elif not eq:
                die(f"{arg!r} has no value: write --{key}=VALUE")
            try:
                value = ast.literal_eval(text)
            except (ValueError, SyntaxError):
                value = text  # a bare string, e.g. --model=data/tiny
            if isinstance(defaults.get(key), str) and not isinstance(value, str):
                value = text  # a string key takes the text as written: --rollout_cpus=1
            defaults[key] = _typed(defaults, key, value, arg)
        else:
            if not os.path.isfile(arg):
                die(f"config file {arg!r} not found (configs live in config/, e.g. config/tiny.py)")
            file_scope = {}
            exec(open(arg).read(), file_scope)
            for key, value in file_scope.items():
                if not key.startswith("__"):
                    defaults[key] = _typed(defaults, key, value, arg)
    scope.update(defaults)
    return defaults


def resolve_model(name):
    """A local model folder, or a Hugging Face hub id (downloaded once into the hub cache) -> a local folder."""
    if os.path.isdir(name):
        if not os.path.isfile(os.path.join(name, "config.json")):
            die(f"model folder {name!r} has no config.json: it is not a Hugging Face model folder "
                "(`python prepare.py tiny|smollm2` makes an offline one)")
        return name
    try:
        from huggingface_hub import snapshot_download
        return snapshot_download(name, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken"])
    except Exception as e:
        die(f"model {name!r} is not a local model folder and could not be loaded from the Hugging Face hub "
            f"({type(e).__name__}). Offline? Download it where the hub is reachable "
            f"(`hf download {name} --local-dir data/NAME`) and pass --model=data/NAME, or make an offline model "
            "with `python prepare.py tiny|smollm2`")


def check(cfg, world):
    """Everything that can be checked before a process starts. Returns the config with the model resolved."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    import reward
    if cfg["batch_groups"] % world:
        die(f"batch_groups={cfg['batch_groups']} is not divisible by the {world} trainer ranks: use a multiple "
            f"of {world}")
    if cfg["max_staleness"] < 0:
        die(f"max_staleness={cfg['max_staleness']} must be >= 0 (0 = synchronous)")
    if cfg["rollout_engines"] < 1 or cfg["tensor_parallel_size"] < 1:
        die("rollout_engines and tensor_parallel_size must be >= 1")
    cfg = dict(cfg, model=resolve_model(cfg["model"]))
    model_config = json.load(open(os.path.join(cfg["model"], "config.json")))
    archs = model_config.get("architectures") or []
    if model_config.get("model_type") not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or \
            archs and not any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs):
        die(f"model {cfg['model']!r} is a {'/'.join(archs) or model_config.get('model_type')!r} model, not a "
            "causal language model: use a decoder-only LM (one that AutoModelForCausalLM loads)")
    try:  # the rollout processes load the task too; a bad dataset is cheaper to report here
        reward.load_task(cfg)
    except (OSError, ValueError, KeyError) as e:
        die(str(e))
    if cfg["resume"] and not os.path.isfile(os.path.join(cfg["out_dir"], "ckpt.pt")):
        die(f"--resume: no checkpoint at {cfg['out_dir']}/ckpt.pt; run without --resume (and with "
            "--ckpt_every=K to write one)")
    return cfg
