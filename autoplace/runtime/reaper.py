"""Run a command that dies with its parent: ``python -m autoplace.runtime.reaper PPID CMD...``.

A trial runs torchrun in a session of its own (so a timeout can kill every rank at once); if
the tune process itself is killed, nothing would stop that session and a hung trial would run
for ever.  This shim asks Linux to send SIGTERM when its parent dies (``PR_SET_PDEATHSIG``;
torchrun forwards it to its ranks), then becomes the command (the setting survives exec).
Elsewhere it simply execs.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def main(argv: list[str]) -> None:
    parent, cmd = int(argv[0]), argv[1:]
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the request took effect
            sys.exit(1)
    os.execvp(cmd[0], cmd)


if __name__ == "__main__":
    main(sys.argv[1:])
