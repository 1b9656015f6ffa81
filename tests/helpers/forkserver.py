"""The tests' `python` children, forked from a process that has imported torch and hivemind.

Every child the tests start (an `atomc` command, a peer, a SWARM server, torchrun and each of
its ranks) would import torch and hivemind afresh: 3-4 s of CPU each on the 2-core CI machine,
about a third of make test's CPU. A fork server, one per pytest process, imports them once;
`subprocess.Popen` (patched by `install`, in the pytest process and so in every child) asks it
for each launch of `sys.executable` with a script, `-m module` or `-c code` (and `-u`), and the
server forks a child that takes the launch's argv, environment, working directory, standard
streams and session, and runs it as `python` would (runpy), exit status included. A launch of
anything else (another executable or interpreter flag, preexec_fn, pass_fds, a user, group or
umask, variables read at a process's start that differ from the server's, such as
MALLOC_MMAP_THRESHOLD_, or ATOMC_TEST_FORKSERVER=0) is executed as before.

What a child can tell: its parent process is the fork server, not its launcher (the server
records the launcher: `launchers`, which tests/processes.py's process trees read), and its
hash seed is the server's. The launcher waits for it through the server, which reports its
exit status. ATOMC_TEST_FORKSERVER=0 turns the server off.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ENV = "ATOMC_TEST_FORKSERVER"  # the server's socket in every child's environment; "0": off
# what the children import, once: torch, hivemind, and the atomc modules the tests' commands,
# peers, SWARM servers and layout ranks run (the checkout's, as the children import it; with
# PYTHONDONTWRITEBYTECODE set each child would compile them again, about 1 s of CPU).
# torch._dynamo too: torch imports it on the first call of a function it keeps out of
# compilation (an optimizer's constructor, a meta tensor's normal_), 2-3 s of CPU a child
PRELOAD = ("torch", "torch._dynamo", "torch.distributed.run", "hivemind", "numpy", "atomc.cli",
           "atomc.distributed.peer", "atomc.distributed.runner", "atomc.swarm.server",
           "atomc.swarm.client", "atomc.runtime.trainer")
_HEADER = struct.Struct("!I")

_original = {name: getattr(subprocess.Popen, name)
             for name in ("_execute_child", "_internal_poll", "_wait")}
_lock = threading.Lock()
_server: subprocess.Popen | None = None
_server_group: int | None = None  # its process group (None: not known here)
_server_start: dict[str, str] | None = None  # its environment's _read_at_start


# ---- the launcher's side ---------------------------------------------------------------------


def _socket_path() -> str | None:
    """The server's socket, started on first use in the pytest process."""
    global _server, _server_group, _server_start
    path = os.environ.get(ENV, "")
    if path == "0":
        return None
    if path:
        return path
    with _lock:
        if _server is None:
            d = Path(tempfile.mkdtemp(prefix="atomc-forkserver-"))
            path = str(d / "socket")
            log = open(d / "server.log", "wb")
            _server = subprocess.Popen(
                [sys.executable, __file__, path], stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, env={**os.environ, ENV: "0"})
            deadline = time.monotonic() + 120
            while not os.path.exists(path + ".ready"):
                if _server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the tests' fork server did not start:\n"
                                       f"{(d / 'server.log').read_text()[-3000:]}")
                time.sleep(0.05)
            os.environ[ENV] = path
            _server_group = os.getpgid(_server.pid)
            _server_start = _read_at_start(os.environ)
            import atexit
            import shutil

            atexit.register(shutil.rmtree, d, ignore_errors=True)  # after the kill: last in
            atexit.register(_server.kill)
        return os.environ[ENV]


def _read_at_start(env) -> dict[str, str]:
    """The variables of `env` that take effect when a process starts (glibc's malloc
    tunables, the dynamic loader's, the interpreter's own); a fork keeps the server's."""
    return {os.fsdecode(k): os.fsdecode(v) for k, v in env.items()
            if os.fsdecode(k).startswith(("MALLOC_", "GLIBC_", "LD_", "PYTHON"))
            and os.fsdecode(k) not in ("PYTHONPATH", "PYTHONUNBUFFERED")}


def _launch(args) -> dict | None:
    """What the server runs for argv `args`, or None where it cannot be a fork."""
    if isinstance(args, (str, bytes, os.PathLike)):
        return None
    args = [os.fspath(a) for a in args]
    if not args or args[0] != sys.executable or any(not isinstance(a, str) for a in args):
        return None
    rest, unbuffered = args[1:], False
    while rest and rest[0] == "-u":
        rest, unbuffered = rest[1:], True
    if not rest:
        return None
    if rest[0] in ("-m", "-c") and len(rest) >= 2:
        return {"kind": rest[0], "target": rest[1], "argv": rest[2:], "unbuffered": unbuffered}
    if rest[0].startswith("-"):
        return None
    return {"kind": "script", "target": rest[0], "argv": rest[1:], "unbuffered": unbuffered}


def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env,
                   startupinfo, creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite,
                   errread, errwrite, restore_signals, gid, gids, uid, umask, start_new_session,
                   process_group):
    launch = path = None
    child_env = os.environ if env is None else env
    if (executable is None and not shell and preexec_fn is None and not pass_fds
            and gid is None and not gids and uid is None and umask < 0
            and process_group in (None, -1) and child_env.get(ENV) != "0"):
        launch = _launch(args)
    if launch is not None:
        path = _socket_path()
    if path is not None and not start_new_session and _server_group != os.getpgid(0):
        # a child that stays in its launcher's process group must be in it: only a launcher
        # in the server's own group (the pytest process) can have one forked
        path = None
    if path is not None and _read_at_start(child_env) != _server_start:
        path = None  # the C library or the interpreter would have read them at its start
    if path is None:
        return _original["_execute_child"](
            self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
            creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite,
            restore_signals, gid, gids, uid, umask, start_new_session, process_group)
    launch.update(env={os.fsdecode(k): os.fsdecode(v) for k, v in child_env.items()},
                  cwd=os.fspath(cwd) if cwd is not None else os.getcwd(),
                  new_session=bool(start_new_session), launcher=os.getpid())
    fds = [p2cread if p2cread != -1 else 0, c2pwrite if c2pwrite != -1 else 1,
           errwrite if errwrite != -1 else 2]
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
        body = json.dumps(launch).encode()
        socket.send_fds(conn, [_HEADER.pack(len(body))], fds)
        conn.sendall(body)
        self._forked_buffer = b""
        reply = _read_line(self, conn).decode(errors="replace")
        if reply.startswith("E"):  # as Popen raises it: FileNotFoundError for a missing cwd
            errno, strerror, filename = reply[1:].split(":", 2)
            raise OSError(int(errno), strerror, filename)
        self.pid = int(reply[1:])
    except BaseException:
        conn.close()
        raise
    finally:
        self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)
    self._forked = conn
    self._child_created = True


def _read_line(proc: subprocess.Popen, conn: socket.socket) -> bytes:
    """The server's next line; what arrived of an unfinished one stays in the buffer."""
    while b"\n" not in proc._forked_buffer:
        chunk = conn.recv(64)
        if not chunk:
            raise OSError("fork server closed the connection")
        proc._forked_buffer += chunk
    line, proc._forked_buffer = proc._forked_buffer.split(b"\n", 1)
    return line.strip()


def _status(self, timeout: float | None) -> bool:
    """Read the forked child's exit status if it comes within `timeout` (None: wait)."""
    conn = self._forked
    conn.settimeout(timeout)
    try:
        line = _read_line(self, conn)
    except (TimeoutError, BlockingIOError):
        return False
    except OSError:  # the server is gone: nothing will report this child
        line = b"X-9"
    finally:
        conn.settimeout(None)
    self.returncode = int(line[1:])
    conn.close()
    return True


def _internal_poll(self, _deadstate=None, _original=_original, **kwargs):
    # _original bound here: Popen.__del__ can poll at interpreter exit, globals gone
    if getattr(self, "_forked", None) is None:
        return _original["_internal_poll"](self, _deadstate, **kwargs)
    if self.returncode is None:
        _status(self, 0.0)
    return self.returncode


def _wait(self, timeout, _original=_original):
    if getattr(self, "_forked", None) is None:
        return _original["_wait"](self, timeout)
    if self.returncode is None and not _status(self, timeout):
        raise subprocess.TimeoutExpired(self.args, timeout)
    return self.returncode


def install() -> None:
    """Launch `python` children through the fork server from now on (this process and every
    child it forks)."""
    if os.environ.get(ENV) == "0":
        return
    subprocess.Popen._execute_child = _execute_child
    subprocess.Popen._internal_poll = _internal_poll
    subprocess.Popen._wait = _wait


def launchers() -> dict[int, int]:
    """Child pid -> the pid that launched it, for the fork server's live children."""
    path = os.environ.get(ENV, "")
    if path in ("", "0"):
        return {}
    try:
        return {int(c): int(p) for c, p in json.loads(Path(path + ".children").read_text())}
    except (OSError, ValueError):
        return {}


# ---- the server ------------------------------------------------------------------------------


def _child(request: dict, fds: list[int], closing: list[int], ready: int) -> None:
    """In the forked child: become the launch, say so on `ready` (or why not: as Popen, the
    launcher returns once the child has its session, streams and folder), run it, exit with
    its status."""
    code = 1
    try:
        for fd in closing:
            os.close(fd)
        try:
            if request["new_session"]:
                os.setsid()
            for i, fd in enumerate(fds):
                if fd != i:
                    os.dup2(fd, i)
            for fd in set(fds) - {0, 1, 2}:
                os.close(fd)
            os.chdir(request["cwd"])
        except OSError as e:
            os.write(ready, f"E{e.errno}:{e.strerror}:{request['cwd']}".encode())
            os._exit(255)
        os.write(ready, b"ok")
        os.close(ready)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        env = request["env"]
        os.environ.clear()
        os.environ.update(env)
        code = _run(request, env)
    except SystemExit as e:
        code = _exit_code(e)
    except BaseException:  # noqa: BLE001 - what the interpreter does with an uncaught one
        sys.excepthook(*sys.exc_info())
        code = 1
    finally:
        try:
            threading._shutdown()  # as the interpreter does at exit: non-daemon threads end
        except BaseException:  # noqa: BLE001 - exiting either way
            pass
        try:
            import atexit

            atexit._run_exitfuncs()
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except BaseException:  # noqa: BLE001 - a closed stream at exit
                    pass
            os._exit(code)


def _exit_code(e: SystemExit) -> int:
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)
    return 1


def _run(request: dict, env: dict) -> int:
    import importlib
    import io
    import random
    import runpy
    import types

    import torch

    # a fresh interpreter's state where the server's would differ: threads, draws, path, log
    threads = env.get("OMP_NUM_THREADS", "")
    torch.set_num_threads(int(threads) if threads.isdigit() and int(threads) > 0
                          else _DEFAULT_THREADS)
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    if "hivemind.utils.logging" in sys.modules:
        import logging

        level = env.get("HIVEMIND_LOGLEVEL", "INFO")
        sys.modules["hivemind.utils.logging"].loglevel = level
        logging.getLogger("hivemind").setLevel(level)
    os.environ[ENV] = _SOCKET  # its own children launch through this server too
    importlib.invalidate_caches()  # modules written since the server started
    kind, target = request["kind"], request["target"]
    first = {"-c": "", "-m": os.getcwd()}.get(kind) or os.path.dirname(os.path.abspath(target))
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [first, *extra, *_BASE_PATH]
    if request["unbuffered"] or env.get("PYTHONUNBUFFERED"):
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True,
                                      encoding=sys.stdout.encoding, errors=sys.stdout.errors)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True,
                                      encoding=sys.stderr.encoding, errors="backslashreplace")
    main = types.ModuleType("__main__")
    sys.modules["__main__"] = main
    if kind == "-m":
        sys.argv = ["-m", *request["argv"]]
        # run as __main__ afresh, as `python -m` does (runpy warns of a module imported already)
        sys.modules.pop(target, None)
        runpy._run_module_as_main(target, alter_argv=True)
    elif kind == "-c":
        sys.argv = ["-c", *request["argv"]]
        exec(compile(target, "<string>", "exec"), main.__dict__)
    else:
        sys.argv = [target, *request["argv"]]
        if not os.path.exists(target):
            print(f"{sys.executable}: can't open file {os.path.abspath(target)!r}: [Errno 2] "
                  f"No such file or directory", file=sys.stderr)
            return 2
        runpy.run_path(target, run_name="__main__")
    return 0


def _serve(path: str) -> None:
    global _BASE_PATH, _DEFAULT_THREADS, _SOCKET, _server_group, _server_start
    import importlib

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    import torch

    _DEFAULT_THREADS = torch.get_num_threads()
    _server_group = os.getpgid(0)
    _server_start = _read_at_start(os.environ)
    env_path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    _BASE_PATH = [p for p in sys.path[1:] if p not in env_path]
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    os.environ[ENV] = _SOCKET = path  # the children launch through this server too
    install()
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    children: dict[int, tuple[socket.socket, int]] = {}  # pid -> (launcher's connection, launcher)
    parent = os.getppid()

    def record() -> None:
        tmp = path + ".children.tmp"
        Path(tmp).write_text(json.dumps([[c, p] for c, (_, p) in children.items()]))
        os.replace(tmp, path + ".children")

    record()
    Path(path + ".ready").touch()
    while os.getppid() == parent:
        for _key, _ in sel.select(timeout=0.05):
            conn, _ = listener.accept()
            try:
                head, fds, _, _ = socket.recv_fds(conn, _HEADER.size, 3)
                (size,) = _HEADER.unpack(head)
                body = b""
                while len(body) < size:
                    chunk = conn.recv(size - len(body))
                    if not chunk:
                        raise OSError("launcher closed the connection")
                    body += chunk
                request = json.loads(body)
            except (OSError, ValueError, struct.error) as e:
                conn.close()
                print(f"bad request: {e}", flush=True)
                continue
            sys.stdout.flush()
            ready_r, ready_w = os.pipe()
            pid = os.fork()
            if pid == 0:
                _child(request, fds, [listener.fileno(), conn.fileno(), ready_r,
                                      *(c.fileno() for c, _ in children.values()),
                                      sel.fileno()], ready_w)
            os.close(ready_w)
            for fd in fds:
                os.close(fd)
            said = os.read(ready_r, 4096)
            os.close(ready_r)
            if said != b"ok":  # it could not start: the launcher raises, as Popen does
                os.waitpid(pid, 0)
                try:
                    conn.sendall(said.replace(b"\n", b" ") + b"\n")
                except OSError:
                    pass
                conn.close()
                continue
            children[pid] = (conn, request["launcher"])
            record()
            try:
                conn.sendall(b"P%d\n" % pid)
            except OSError:
                pass
        ended = False
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                conn, _ = children.pop(pid)
                ended = True
                try:
                    conn.sendall(b"X%d\n" % os.waitstatus_to_exitcode(status))
                except OSError:
                    pass
                conn.close()
        if ended:
            record()


_BASE_PATH: list[str] = []  # the server's sys.path less its script's folder and PYTHONPATH
_DEFAULT_THREADS = 1  # torch's threads in a process not told OMP_NUM_THREADS
_SOCKET = ""

if __name__ == "__main__":
    _serve(sys.argv[1])
