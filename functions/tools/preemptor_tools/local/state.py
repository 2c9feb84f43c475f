"""The state file of a running local stack (`preemptor local up`), read by `local down` and
every `--local` command. Light on purpose: reading it imports neither moto nor the stack."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

STATE_ENV = "PREEMPTOR_LOCAL_STATE"
LOOPBACK = "127.0.0.1"
DEFAULT_PORT = 4599
# The local stack's only credentials: moto accepts any, AWS none of these.
FAKE_CREDENTIALS = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing", "aws_session_token": "testing"}


def default_state_path(env: dict[str, str] | None = None) -> Path:
    """Where the running local stack is described: $PREEMPTOR_LOCAL_STATE, else
    $XDG_RUNTIME_DIR/preemptor/local.json, else .preemptor/local.json here."""
    env = dict(os.environ) if env is None else env
    if env.get(STATE_ENV):
        return Path(env[STATE_ENV])
    if env.get("XDG_RUNTIME_DIR"):
        return Path(env["XDG_RUNTIME_DIR"]) / "preemptor" / "local.json"
    return Path(".preemptor") / "local.json"


class DeployFailed(Exception):
    """The emulated stack could not be deployed: the reason CloudFormation would give, one
    line (its configuration check, `preemptor.handlers.config_check`). Here, where the CLI
    finds it without importing the emulator."""


class LocalStackError(Exception):
    """The local stack cannot start, or cannot be reached."""


class NoLocalStack(LocalStackError):
    """No local stack is running."""


@dataclass(frozen=True)
class LocalState:
    """What the state file says about a running local stack."""

    pid: int
    port: int
    region: str
    stack: str
    outputs: dict[str, str]
    parameters: dict[str, str]
    speed: float
    sim_now: float  # the simulated clock at `real_at` (wall-clock seconds)
    real_at: float
    started_at: float
    stops_at: float

    @property
    def endpoint_url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def now(self, wall: float | None = None) -> float:
        """The local stack's simulated time now (from the clock it last published)."""
        wall = time.time() if wall is None else wall
        return self.sim_now + max(0.0, wall - self.real_at) * self.speed

    def _problem(self) -> str | None:
        """What is wrong with the file's values, if anything. The pid is signalled by `local
        down`: 0 or a negative one would signal a process group, or every process the user
        may signal."""
        if type(self.pid) is not int or self.pid < 2:
            return f"field pid: expected a process id > 1, got {self.pid!r}"
        if type(self.port) is not int or not 0 < self.port < 65536:
            return f"field port: expected a TCP port, got {self.port!r}"
        for name in ("speed", "sim_now", "real_at", "started_at", "stops_at"):
            value = getattr(self, name)
            if type(value) not in (int, float):
                return f"field {name}: expected a number, got {value!r}"
        for name in ("region", "stack"):
            if not isinstance(getattr(self, name), str):
                return f"field {name}: expected a string, got {getattr(self, name)!r}"
        for name in ("outputs", "parameters"):
            if not isinstance(getattr(self, name), dict):
                return f"field {name}: expected an object, got {getattr(self, name)!r}"
        return None

    def to_dict(self) -> dict:
        return {**self.__dict__, "endpoint_url": self.endpoint_url}

    @classmethod
    def read(cls, path: Path) -> "LocalState":
        """The running stack's state; LocalStackError if none is (a stale file is removed)."""
        try:
            data = json.loads(path.read_text())
            state = cls(**{k: data[k] for k in cls.__dataclass_fields__})
        except FileNotFoundError:
            raise NoLocalStack(f"no local stack is running (no {path}): start one with `preemptor local up`") from None
        except (ValueError, KeyError, TypeError) as e:
            raise LocalStackError(f"{path} is not a local stack's state file ({type(e).__name__}: {e})") from None
        except OSError as e:
            raise LocalStackError(f"{path}: cannot be read as a local stack's state file ({e.strerror or e})") from None
        problem = state._problem()
        if problem:
            raise LocalStackError(f"{path} is not a local stack's state file ({problem})")
        if not alive(state.pid):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            raise NoLocalStack(f"no local stack is running (pid {state.pid} is gone; removed {path})")
        return state


def alive(pid: int) -> bool:
    """Whether process `pid` exists and has not exited (an exited child its parent has not
    reaped yet, a zombie, counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: alive, and not ours to signal
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no /proc here: the signal test is all there is
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def stop(path: Path, timeout_s: float = 20.0) -> LocalState:
    """Stop the local stack described by `path` (SIGTERM to its pid) and wait until it is gone."""
    state = LocalState.read(path)
    if not _is_local_stack(state.pid):
        raise LocalStackError(f"pid {state.pid} in {path} is not a `preemptor local up` process: not touching it")
    os.kill(state.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while alive(state.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if alive(state.pid):
        raise LocalStackError(f"the local stack (pid {state.pid}) did not stop within {timeout_s:g} s")
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    return state


def _is_local_stack(pid: int) -> bool:
    """Whether `pid` runs `preemptor local up` (where /proc tells; elsewhere trust the file)."""
    cmdline = Path(f"/proc/{pid}/cmdline")
    if not cmdline.parent.exists():
        return True
    try:
        args = cmdline.read_bytes().split(b"\0")
    except OSError:
        return False
    return b"local" in args and b"up" in args
