"""The audit log: who compiled, signed, verified, loaded what, and when (issue 24, part 6).

Off unless asked for: ``CUVIL_AUDIT_LOG=FILE`` in the environment, or ``cuvil.audit.configure(FILE)`` (which
wins over the variable; ``configure(None)`` turns it off again). Each event is one JSON line appended to FILE::

    {"time": "2026-12-02T12:00:00.123456+00:00", "event": "load", "artifact": "/srv/libnet.so",
     "digest": "sha256:4c1f...", "outcome": "ok", "user": "alice", "pid": 4242}

``event`` is one of :data:`EVENTS`; ``digest`` the SHA-256 of the library (x86) or of the bundle's digest
manifest (GPU: :func:`cuvil.signing.artifact_digest`); ``outcome`` ``ok``, ``refused`` (a check said no: an
altered artifact, a wrong key) or ``error`` (the work failed), with ``reason`` for the last two. Other fields
are scalars only (strings, numbers, booleans): a value such as an array is refused, so no tensor reaches the
log.

A line is written with one ``write`` on a descriptor opened ``O_APPEND`` while holding an exclusive ``flock``
on the file: lines of concurrent processes never interleave, and a reader that takes the same lock sees only
whole lines. A log that cannot be written is an error (fail closed: an audited deployment must not run
unaudited), with the next step in its hint.
"""
from __future__ import annotations

import datetime
import fcntl
import json
import os
import pwd
import threading
from typing import Callable, Optional, Union

from .errors import CuvilError

#: The events Cuvil records.
EVENTS = ("compile", "sign", "verify", "load", "session-create")
#: The outcomes an event may have.
OUTCOMES = ("ok", "refused", "error")
#: The environment variable that names the log file.
ENV = "CUVIL_AUDIT_LOG"

_UNSET = object()
_configured: object = _UNSET          # a path, None (off), or _UNSET (follow the environment)
_lock = threading.Lock()              # flock is per open file description: one writer per process at a time too


def configure(path: Union[str, os.PathLike, None]) -> None:
    """Append audit events to ``path`` from now on (``None``: record nothing, whatever ``CUVIL_AUDIT_LOG``
    says). The file is created (mode 0600) if needed; one that cannot be opened for appending is a
    CuvilError now, not at the first event."""
    global _configured
    if path is None:
        _configured = None
        return
    path = os.fspath(path)
    os.close(_open(path))
    _configured = path


def reset() -> None:
    """Follow ``CUVIL_AUDIT_LOG`` again (undo :func:`configure`)."""
    global _configured
    _configured = _UNSET


def log_path() -> Optional[str]:
    """The file events go to, or None when the log is off."""
    if _configured is not _UNSET:
        return _configured  # type: ignore[return-value]
    return os.environ.get(ENV) or None


def enabled() -> bool:
    return log_path() is not None


def _open(path: str) -> int:
    try:
        return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as e:
        raise CuvilError(f"audit log {path}: cannot append to it: {e.strerror}",
                         hint=f"point {ENV} (or cuvil.audit.configure) at a writable file, or unset it to "
                              f"record nothing") from None


def _scalar(key: str, value):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"audit field {key!r}: {type(value).__name__} is not a scalar; the audit log records "
                    f"strings, numbers and booleans only (never tensors)")


def record(event: str, *, artifact: Optional[str] = None,
           digest: Union[str, Callable[[], Optional[str]], None] = None,
           outcome: str = "ok", reason: Optional[str] = None, **fields) -> None:
    """Append one event (a no-op when the log is off). ``digest`` may be a callable, called only when the
    log is on (hashing a library costs a read); its hex value is written as ``sha256:HEX``."""
    path = log_path()
    if path is None:
        return
    if event not in EVENTS:
        raise ValueError(f"audit event {event!r}: expected one of {', '.join(EVENTS)}")
    if outcome not in OUTCOMES:
        raise ValueError(f"audit outcome {outcome!r}: expected one of {', '.join(OUTCOMES)}")
    if callable(digest):
        try:
            digest = digest()
        except (OSError, CuvilError):
            digest = None                     # the file went away: the event is still recorded
    entry = {"time": datetime.datetime.now(datetime.timezone.utc).isoformat(), "event": event,
             "artifact": None if artifact is None else os.path.abspath(os.fspath(artifact)),
             "digest": None if digest is None else (digest if ":" in digest else f"sha256:{digest}"),
             "outcome": outcome}
    if reason is not None:
        entry["reason"] = str(reason)
    entry.update({k: _scalar(k, v) for k, v in fields.items()})
    entry["user"] = _user()
    entry["pid"] = os.getpid()
    line = (json.dumps(entry, sort_keys=False, ensure_ascii=True) + "\n").encode("ascii")
    with _lock:
        fd = _open(path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                view = memoryview(line)
                while view:   # one write in practice; a short write (a full disk) continues under the lock
                    view = view[os.write(fd, view):]
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        except OSError as e:
            raise CuvilError(f"audit log {path}: cannot write the {event} event: {e.strerror}",
                             hint=f"free space or fix the permissions of {path}, or unset {ENV} to record "
                                  f"nothing") from None
        finally:
            os.close(fd)


def read(path: Union[str, os.PathLike]) -> list:
    """The events of a log file as dicts (under a shared lock, so no half-written line is seen)."""
    with open(path, "rb") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_SH)
        try:
            data = f.read()
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
    return [json.loads(line) for line in data.splitlines() if line.strip()]


def _user() -> str:
    """The account the process runs as, from its uid: not ``getpass.getuser()``, which believes ``$USER`` /
    ``$LOGNAME`` (``USER=alice cuvil ...`` would be logged as alice)."""
    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:   # no passwd entry (a container's arbitrary uid)
        return str(os.getuid())
