"""env.py: a user's own environment, `task = "env:MODULE:CLASS"`. Runs in the engine process
(rollout.py drives an Envs), in a fork server it starts, and in one process per answer; the
trainer runs only load() and smoke(), before anything heavy starts.

The protocol, one small class: CLASS(seed) with an int seed; reset() -> the prompt (text, or chat
messages); step(text) takes the model's whole turn -> (observation, reward, done): the reply
(text, or None when done), a float, a bool. An answer's reward is the sum of its steps'. Also
accepted, gymnasium's shapes: reset() -> (obs, info), step() -> (obs, reward, terminated,
truncated, info). Optional: close(); a class attribute `stop`, text that ends a model turn (a tool
call), after which the reply continues the model's message instead of coming as a user turn.

Why a process per answer: the object keeps its state across the answer's turns and nowhere else,
and a step that hangs is ended by killing that one process, which loses no other answer. The
processes fork from a server that imported the module once, so each costs a fork (milliseconds,
a few MB), not an import. Simplifications: a process per live answer (so replies are expected to
be quick or to wait on something else: their waits overlap generation); no vectorised envs."""
import contextlib, importlib, multiprocessing, os, resource, sys, time, traceback, types
from multiprocessing.connection import wait

EVAL_SEEDS = 1_000_000  # held-out seeds are 0..eval_n-1; training seeds start here


def load(spec):
    """"env:MODULE:CLASS" -> (the class, its module's importable name). MODULE is dotted, from
    the working directory, or a .py file's path; a path's folder goes on sys.path so that the
    fork server (a fresh interpreter) imports it by name too."""
    try:
        _, module, name = spec.split(":")
    except ValueError:
        raise ValueError(f"task {spec!r}: write env:MODULE:CLASS, e.g. env:envs/guess.py:"
                         "GuessNumber") from None
    folder = os.getcwd()  # `python train.py` has its own folder, not the cwd
    if module.endswith(".py"):
        if not os.path.isfile(module):
            raise ValueError(f"task {spec!r}: no file {module!r}")
        folder, module = os.path.split(os.path.abspath(module[:-3]))
    if folder not in sys.path:  # load() runs more than once a process
        sys.path.insert(0, folder)
    try:
        cls = getattr(importlib.import_module(module), name)
    except Exception as e:  # an ImportError, or whatever the module raised as it loaded
        raise ValueError(f"task {spec!r}: {type(e).__name__}: {e}") from None
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if missing or not callable(cls):
        raise ValueError(f"task {spec!r}: {name} has no {' or '.join(missing)} method: an "
                         "environment is a class with reset() and step(text)")
    return cls, module


def prompt_of(cls, out):  # reset()'s value -> text or chat messages
    out = out[0] if isinstance(out, tuple) and len(out) == 2 else out  # gymnasium: (obs, info)
    chat = isinstance(out, list) and all(isinstance(m, dict) and "content" in m for m in out)
    if not (isinstance(out, str) or chat and out):
        raise TypeError(f"{cls.__name__}.reset() returned {out!r:.80} ({type(out).__name__}): "
                        "want text, or chat messages [{'role': 'user', 'content': ...}]")
    return out


def reply_of(cls, out):  # step()'s value -> (observation or None, reward, done)
    if isinstance(out, tuple) and len(out) == 5:  # gymnasium: terminated or truncated
        out = (out[0], out[1], bool(out[2]) or bool(out[3]))
    if not (isinstance(out, tuple) and len(out) == 3):
        raise TypeError(f"{cls.__name__}.step() returned {out!r:.80} ({type(out).__name__}): "
                        "want (observation, reward, done), or gymnasium's (observation, reward, "
                        "terminated, truncated, info)")
    obs, reward, done = out
    if not (isinstance(obs, str) or obs is None and done):
        raise TypeError(f"{cls.__name__}.step() returned the observation {obs!r:.80} "
                        f"({type(obs).__name__}): want text, or None when done")
    reward = float(reward)
    if reward != reward or abs(reward) == float("inf"):
        raise ValueError(f"{cls.__name__}.step() returned the reward {reward}")
    return obs, reward, bool(done)


def serve(conn, spec, seed):
    """An answer's process: CLASS(seed), reset(), then a step() per message until None. Each
    reply is ("ok", value) or ("error", traceback); an error ends the process."""
    from reward import confine
    confine()
    env = None
    try:
        cls, _ = load(spec)
        env = cls(seed)
        conn.send((prompt_of(cls, env.reset()), None))
        while (text := conn.recv()) is not None:
            conn.send((reply_of(cls, env.step(text)), None))
    except EOFError:  # the engine went away
        pass
    except BaseException:
        conn.send((traceback.format_exc(), "error"))
    finally:
        if env is not None and callable(getattr(env, "close", None)):
            env.close()


class Envs:
    """The engine's side: start(key, seed) opens an answer's process and resets it, call(key,
    text) steps it, poll() -> [(key, value, fault)] with fault None, "error" (value: the
    traceback) or "timeout" (killed past timeout_s), end(key) lets it go."""

    def __init__(self, spec, timeout_s):
        _, module = load(spec)
        self.spec, self.timeout_s = spec, timeout_s
        self.ctx = multiprocessing.get_context("forkserver")
        self.ctx.set_forkserver_preload(["env", "reward", module])  # imported once, forked
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # 2 descriptors an answer
        if soft != resource.RLIM_INFINITY and soft < 1 << 16:  # 1,024 by default: too few
            want = 1 << 16 if hard == resource.RLIM_INFINITY else min(hard, 1 << 16)
            resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, want), hard))
        self.live = {}  # key -> (process, connection)
        self.running = {}  # key -> deadline of the call it has not answered yet

    def start(self, key, seed):
        ours, theirs = self.ctx.Pipe()
        p = self.ctx.Process(target=serve, args=(theirs, self.spec, seed))  # may have children
        main = sys.modules["__main__"]  # a child would run our script again (no main guard)
        sys.modules["__main__"] = types.ModuleType("__main__")  # serve() needs none of it
        try:
            p.start()
        finally:
            sys.modules["__main__"] = main
        theirs.close()
        self.live[key] = (p, ours)
        self.running[key] = time.monotonic() + self.timeout_s

    def call(self, key, text):
        self.live[key][1].send(text)
        self.running[key] = time.monotonic() + self.timeout_s

    def wait(self, timeout):  # until a reply, or timeout seconds
        wait([self.live[k][1] for k in self.running], timeout)

    def poll(self):
        done, now = [], time.monotonic()
        for key, deadline in list(self.running.items()):
            p, conn = self.live[key]
            try:
                if conn.poll():
                    done.append((key, *conn.recv()))  # (value, None) or (traceback, "error")
                elif now > deadline:
                    done.append((key, f"no reply in reward_timeout_s={self.timeout_s}", "timeout"))
                else:
                    continue
            except (EOFError, OSError):  # it died without a word (killed, out of memory)
                p.join(1)
                done.append((key, f"its process died (exit code {p.exitcode})", "error"))
            del self.running[key]
            if done[-1][2]:  # a failed answer is over; a hung process is killed
                self.end(key, kill=done[-1][2] == "timeout")
        return done

    def end(self, key, kill=False):  # the answer is over: its process closes the env, exits
        p, conn = self.live.pop(key)
        self.running.pop(key, None)
        if kill:
            p.kill()
        else:
            with contextlib.suppress(OSError):  # it has gone already
                conn.send(None)
        conn.close()
        multiprocessing.active_children()  # joins those that exited: no zombies

    def close(self):
        for key in list(self.live):
            self.end(key, kill=True)


def smoke(spec, timeout_s):
    """Before anything heavy starts: seed 0's reset() and a step("") in a child process, as an
    engine runs them. -> None, or what went wrong (the traceback's last line, or the timeout)."""
    envs = Envs(spec, timeout_s)
    try:
        for ask, arg in ((envs.start, 0), (envs.call, "")):  # seed 0's reset(), then step("")
            ask(0, arg)
            while not (got := envs.poll()):
                envs.wait(0.1)
            _, value, fault = got[0]
            if fault:
                return value.strip().splitlines()[-1]
    finally:
        envs.close()
