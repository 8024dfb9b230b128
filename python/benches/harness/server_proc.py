"""A server under test as a child process: the command lines of ``vmem-serve`` and of
``transformers serve --continuous-batching``, started in a process group of their own on a free
loopback port, waited for until they answer, stopped (SIGTERM, then SIGKILL of the whole group),
their log kept; and what the drivers sample while they run: the process tree's resident memory
and the GPU's used memory."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from types import TracebackType
from typing import Any

from harness import serve_run


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def vmem_serve_argv(models: Sequence[tuple[str, str]], port: int, memory: int | None,
                    extra: Sequence[str] = (), command: Sequence[str] | None = None) -> list[str]:
    """``vmem-serve`` serving ``models`` (``(name, path)``; one model with no name is served as
    ``--model PATH``) on 127.0.0.1:``port`` with ``--memory`` bytes of KV (``None``: its
    default), then ``extra``. ``command``: how it is started (default ``python -m vmem.server``)."""
    argv = list(command or [sys.executable, "-m", "vmem.server"])
    for name, path in models:
        argv += ["--model", f"{name}={path}" if name else path]
    argv += ["--host", "127.0.0.1", "--port", str(port)]
    if memory is not None:
        argv += ["--memory", str(memory)]
    return argv + list(extra)


def tf_serve_argv(model: str, port: int, num_blocks: int, block_size: int, device: str,
                  extra: Sequence[str] = ()) -> list[str]:
    """``transformers serve MODEL --continuous-batching`` on 127.0.0.1:``port``, its paged cache
    fixed at ``num_blocks`` blocks of ``block_size`` tokens (the footprint check let through:
    ``--cb-max-memory-percent 0.95``; the blocks, not the percentage, set the cache), on
    ``device``, then ``extra``."""
    return [sys.executable, "-m", "transformers.cli.transformers", "serve", model, "--continuous-batching",
            "--host", "127.0.0.1", "--port", str(port), "--device", device,
            "--cb-block-size", str(block_size), "--cb-num-blocks", str(num_blocks),
            "--cb-max-memory-percent", "0.95", *extra]


def split_args(text: str | None) -> list[str]:
    """A flag's value of more command-line arguments, split as a shell would."""
    return shlex.split(text) if text else []


def spawn(argv: Sequence[str], log_path: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """``argv`` started detached (a process group of its own, so its children stop with it; stdin
    closed), its output appended to ``log_path`` after its command line."""
    with open(log_path, "ab") as log:
        log.write(f"$ {shlex.join(argv)}\n".encode())
        log.flush()
        return subprocess.Popen(list(argv), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True)


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists (a process of another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Server:
    """A server process: ``argv`` run with its output to ``log_path``, detached (its own
    process group, so its children stop with it), answering at ``http://127.0.0.1:port``.
    A context manager: started and waited for on entering (unless started already), stopped on
    leaving."""

    def __init__(self, name: str, argv: Sequence[str], port: int, log_path: str, env: dict[str, str] | None = None,
                 ready_timeout_s: float = 600.0, api_key: str | None = None) -> None:
        self.name, self.argv, self.port, self.log_path = name, list(argv), port, log_path
        self.env = dict(os.environ, **(env or {}))
        self.ready_timeout_s, self.api_key = ready_timeout_s, api_key
        self.proc: subprocess.Popen[bytes] | None = None
        self.ready_s: float | None = None
        self.exit_code: int | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        """Whether the process still runs."""
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> Server:
        """Starts the process and waits until ``/v1/models`` answers 200; a process that stops or
        does not answer within ``ready_timeout_s`` is :class:`harness.serve_run.ServerGone` (with
        its log's last lines), the process stopped. Started twice is a RuntimeError."""
        if self.proc is not None:
            raise RuntimeError(f"{self.name} was started already")
        self.proc = spawn(self.argv, self.log_path, self.env)
        try:
            self.ready_s = serve_run.wait_ready(self.base_url, self.api_key, self.ready_timeout_s, self.alive)
        except serve_run.ServerGone as e:
            self.stop()
            raise serve_run.ServerGone(f"{self.name}: {e} (exit code {self.exit_code}); its log ends:\n"
                                       f"{self.tail()}") from None
        return self

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM to the server (as a process manager stops it: the server stops its own
        children), SIGKILL to its whole process group after ``timeout_s`` or once it exited
        (what outlived it); returns its exit code (negative: the signal that ended it)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self._kill_group()
                self.proc.wait()
        self._kill_group()
        if self.exit_code is None:
            self.exit_code = self.proc.returncode
        return self.exit_code

    def _kill_group(self) -> None:
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    def tail(self, lines: int = 15) -> str:
        """The log's last ``lines`` lines."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 16384))
                return "\n".join(f.read().decode("utf-8", "replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def rss_bytes(self) -> int | None:
        """Resident memory of the process and all its descendants; ``None`` once it ended."""
        if not self.alive():
            return None
        assert self.proc is not None
        return tree_rss(self.proc.pid)

    def __enter__(self) -> Server:
        return self if self.proc is not None else self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def tree_rss(pid: int) -> int | None:
    """Resident bytes of process ``pid`` and its descendants (psutil, else /proc)."""
    try:
        import psutil
    except ImportError:
        return _proc_tree_rss(pid)
    try:
        p = psutil.Process(pid)
        procs = [p, *p.children(recursive=True)]
    except psutil.Error:
        return None
    total = 0
    for q in procs:
        with contextlib.suppress(psutil.Error):
            total += q.memory_info().rss
    return total


def _proc_tree_rss(pid: int) -> int | None:
    parents: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    parents[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    if pid not in parents:
        return None
    tree, frontier = {pid}, [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parents.items() if pp == p and c not in tree]
        tree.update(kids)
        frontier += kids
    page = os.sysconf("SC_PAGE_SIZE")
    total = 0
    for p in tree:
        try:
            with open(f"/proc/{p}/statm") as f:
                total += int(f.read().split()[1]) * page
        except (OSError, ValueError, IndexError):
            pass
    return total


_NVML: Any = None


def gpu_used_bytes(index: int = 0) -> int | None:
    """Used memory of GPU ``index`` as the driver reports it (all processes): NVML
    (``nvidia-ml-py``), else ``nvidia-smi``; ``None`` without either or without a GPU."""
    global _NVML
    try:
        if _NVML is None:
            import pynvml

            pynvml.nvmlInit()
            _NVML = pynvml
        h = _NVML.nvmlDeviceGetHandleByIndex(index)
        return int(_NVML.nvmlDeviceGetMemoryInfo(h).used)
    except Exception:  # noqa: BLE001 (no NVML, no GPU: try nvidia-smi)
        pass
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i",
                              str(index)], capture_output=True, text=True, timeout=10)
        return int(out.stdout.strip().splitlines()[0]) << 20 if out.returncode == 0 else None
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None
