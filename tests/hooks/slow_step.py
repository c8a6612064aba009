"""Every optimizer step takes 8 s: AdamW.step sleeps 8 s first, in the trainer ranks."""
import sys, time
if sys.argv[0].endswith('train.py'):
    import torch
    step = torch.optim.AdamW.step
    torch.optim.AdamW.step = lambda *a, **k: time.sleep(8) or step(*a, **k)
