"""The engine's loop stops moving after 200 iterations, its heartbeat thread going on: from
its 201st call the budget's take sleeps an hour (a driver fault, a deadlock: the process
lives, its loop does not)."""
import sys, time
if sys.argv[0].endswith("rollout.py"):  # the engine's loop asks its budget every iteration
    import budget
    take, calls = budget.Budget.take, []
    def hang_after_200(self, *args):
        calls.append(1)
        if len(calls) > 200:
            time.sleep(3600)  # a driver fault, a deadlock: the process lives, its loop does not
        return take(self, *args)
    budget.Budget.take = hang_after_200
