"""Engine 1 is SIGKILLed as rank 0 starts its second push; the engine's pid and the time
of the kill are written to the file $KILLED."""
import os, sys, time
if sys.argv[0].endswith("train.py"):
    import psutil, sync
    push, pushes = sync.Sender.push, []
    def push_after_a_kill(sender, *args, **kw):
        pushes.append(sender)
        if len(pushes) == 2:  # rank 0's second push: engine 1 dies in it
            engine = [p for p in psutil.Process().children() if p.cmdline()[-1] == "1"][0]
            open(os.environ["KILLED"], "w").write(f"{engine.pid} {time.time()}")
            engine.kill()
        return push(sender, *args, **kw)
    sync.Sender.push = push_after_a_kill
