"""A library loaded from bytes already in memory: a sealed memfd, so nothing can change what was checked
between the check and ``dlopen``.

:func:`sealed_library` copies the bytes into an anonymous memory file (``memfd_create``), seals it against
every change (``F_SEAL_WRITE | F_SEAL_SHRINK | F_SEAL_GROW``, then ``F_SEAL_SEAL``) and returns the path
``dlopen`` reads it through, ``/proc/self/fd/N``. The descriptor stays open for the life of the process, on
purpose: ctypes never unloads a library, and glibc's ``dlopen`` finds an already loaded object by the name
it was opened under, so a closed and reused descriptor number would hand a later load the earlier
library.
"""
from __future__ import annotations

import fcntl
import os
from typing import List

from ...errors import CuvilError

#: Descriptors of the loaded memfds (kept open: see the module docstring).
_OPEN: List[int] = []

_SEALS = ("F_SEAL_WRITE", "F_SEAL_SHRINK", "F_SEAL_GROW", "F_SEAL_SEAL")
#: MFD_EXEC (Linux 6.3+): say that this memfd is mapped executable (where vm.memfd_noexec asks).
_MFD_EXEC = getattr(os, "MFD_EXEC", 0x0010)


def sealed_library(data: bytes, name: str) -> str:
    """The ``/proc/self/fd/N`` path of a sealed memfd holding ``data`` (``name`` shows in /proc/PID/maps as
    ``memfd:NAME``)."""
    if not hasattr(os, "memfd_create") or not all(hasattr(fcntl, s) for s in _SEALS):
        raise CuvilError("this system has no sealed memory files (memfd_create, F_ADD_SEALS), which a verified "
                         "load needs", hint="load on Linux 3.17 or later with Python 3.9 or later, or verify with "
                                            "`cuvil verify-artifact` and load without verify=")
    flags = os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC
    try:
        fd = os.memfd_create(name, flags | _MFD_EXEC)
    except OSError:   # a kernel before 6.3 rejects MFD_EXEC
        fd = os.memfd_create(name, flags)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        seals = 0
        for s in _SEALS:
            seals |= getattr(fcntl, s)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
        if fcntl.fcntl(fd, fcntl.F_GET_SEALS) & seals != seals:
            raise OSError("the seals did not hold")
    except OSError as e:
        os.close(fd)
        raise CuvilError(f"cannot seal the verified bytes of {name} in memory: {e}",
                         hint="check free memory (the library is held in RAM), then load again") from None
    _OPEN.append(fd)
    return f"/proc/self/fd/{fd}"
