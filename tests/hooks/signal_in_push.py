"""Ctrl-C while rank 0 pushes the weights of version 2: in rank 0's second push,
SIGINT goes to torchrun, which passes it to every rank; the push must still finish on
every rank."""
import os, signal, sys, time
if sys.argv[0].endswith("train.py"):
    import sync
    push, pushes = sync.Sender.push, []
    def push_after_a_signal(sender, *args, **kw):
        pushes.append(sender)
        if len(pushes) == 2:  # rank 0's second push (version 2)
            os.kill(os.getppid(), signal.SIGINT)  # Ctrl-C: torchrun passes it to every rank
            time.sleep(2)  # it has arrived: this push must still finish on every rank
        return push(sender, *args, **kw)
    sync.Sender.push = push_after_a_signal
