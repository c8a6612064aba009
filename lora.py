"""lora.py: lora_rank > 0 trains a PEFT adapter on the frozen base's linear layers;
only the adapter travels (sync.py); each engine swaps it in place between steps.
Simplifications: one adapter, no dropout; `prepare.py merge` merges it into the base.

Runs in the trainer ranks (add, save) and inside each engine's vLLM workers (swap, fast_cpu_ops)."""
import sys

import torch

ID = 1  # in vLLM: every request names it


def settings(cfg):  # PEFT's LoraConfig, and vLLM's
    targets = cfg["lora_targets"]
    return {"r": cfg["lora_rank"], "lora_alpha": cfg["lora_alpha"], "lora_dropout": 0.0,
            "target_modules": targets if targets == "all-linear" else targets.split(",")}


def add(net, cfg, dtype):  # adapters in -> the model; base frozen in dtype, no fp32 copy
    from peft import LoraConfig, get_peft_model
    body = net.model.named_modules()  # not the head: loss.py uses its weight
    linear = {n.rpartition(".")[2] for n, m in body if type(m).__name__ == "Linear"}
    if cfg["lora_targets"] != "all-linear" and set(cfg["lora_targets"].split(",")) - linear:
        raise ValueError(f"lora_targets={cfg['lora_targets']!r}: the model's layers to adapt are "
                         f"{','.join(sorted(linear))}, or all-linear")
    net = get_peft_model(net, LoraConfig(**settings(cfg))).get_base_model()
    for p in net.parameters():  # the adapter in fp32 (AdamW's updates are ~1e-5 of a weight)
        p.data = p.data.to(torch.float32 if p.requires_grad else dtype)
    return net


def save(tensors, cfg, out_dir):  # the adapter, as PEFT saves it
    from peft import LoraConfig
    from safetensors.torch import save_file
    LoraConfig(**settings(cfg), base_model_name_or_path=cfg["model"]).save_pretrained(out_dir)
    tensors = {vllm_name(n): t.contiguous() for n, t in tensors.items()}
    save_file(tensors, f"{out_dir}/adapter_model.safetensors")


def servable(archs):
    """Can vLLM serve the model with LoRA? Asked of a child process: a trainer rank that imports
    vLLM is left compiling its layers on one thread. (No vLLM at all: the engines will say.)"""
    import subprocess
    ask = ("import sys; from vllm.model_executor.models.interfaces import supports_lora; "
           "from vllm.model_executor.models.registry import ModelRegistry as R; "
           f"sys.exit(0 if any(supports_lora(R._try_load_model_cls(a)) for a in {archs!r}) else 3)")
    return subprocess.run([sys.executable, "-c", ask], capture_output=True).returncode != 3


def engine_args(cfg, device):  # LLM()'s keywords
    if not cfg.get("lora_rank"):  # (bench's, tests' configs lack it)
        return {}
    if device == "cpu":
        fast_cpu_ops()
    return dict(enable_lora=True, max_loras=1, max_lora_rank=cfg["lora_rank"])


def request(cfg):  # every request names it; the path is never read
    from vllm.lora.request import LoRARequest
    return LoRARequest("policy", ID, "in-memory") if cfg.get("lora_rank") else None


def fast_cpu_ops():
    """vLLM's CPU LoRA ops gather a weight copy per token (3x slower here); with one adapter in
    one slot, every token uses slot 0: one matmul."""
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    def apply(x, w, out):  # x [T, in], w [1, (1,) out, in] -> [T, out] in out's dtype
        return x.to(out.dtype) @ w.reshape(-1, w.shape[-1]).to(out.dtype).t()

    def shrink(x, w, out, idx, scaling=1.0):
        out[:, :w.shape[-2]] = scaling * apply(x, w, out)

    def expand(x, w, out, idx, add_inputs=True):
        expand_slice(x, w, out, idx, 0, min(w.shape[-2], out.shape[1]), add_inputs)

    def expand_slice(x, w, out, idx, offset, size, add_inputs=True):
        y = apply(x, w, out)[:, :size]
        out[:, offset:offset + size] = out[:, offset:offset + size] + y if add_inputs else y
    for m in (lora_ops, punica_cpu):
        m.bgmv_shrink, m.bgmv_expand, m.bgmv_expand_slice = shrink, expand, expand_slice


def vllm_name(name):  # PEFT's name in the model -> the saved adapter's
    return "base_model.model." + name.replace(".default", "")


def swap(worker, tensors, cfg):  # in a vLLM worker: these replace its adapter
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper
    manager = worker.model_runner.lora_manager
    tensors = {vllm_name(n): t.to("cpu", copy=True) for n, t in tensors}
    adapter = LoRAModel.from_lora_tensors(
        ID, tensors, PEFTHelper.from_dict(settings(cfg)), device="cpu",
        dtype=manager.lora_config.lora_dtype, model_vocab_size=manager.vocab_size)
    with torch.no_grad():  # as vLLM adds one: into its slot, on its device
        manager.remove_adapter(ID)
        manager._adapter_manager.add_adapter(adapter)
        manager._adapter_manager.activate_adapter(ID)
