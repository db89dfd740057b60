"""One run per output directory: an exclusive lock on <output_root>/<recipe>/.lock for a run's life.

`fcntl.flock` locks belong to the open file, so the kernel drops the lock when the process dies,
however it dies: a SIGKILLed run leaves nothing to clean up and the next one starts. The file holds
who took the lock (pid, host, start time, command) for the message a second run prints.
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from typing import Optional


class RunLock:
    def __init__(self, directory: str):
        self.directory, self.path = directory, os.path.join(directory, ".lock")
        self.fd: Optional[int] = None

    def acquire(self) -> "RunLock":
        """Takes the lock or raises ValueError naming the run that holds it."""
        os.makedirs(self.directory, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 4096).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise ValueError(f"{self.directory} is in use by another run ({holder}); wait for it to end or stop it, "
                             "or write this run elsewhere (paths.output_root=... or recipe.name=...)") from None
        os.ftruncate(fd, 0)
        info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                "command": " ".join(sys.argv)}
        os.write(fd, json.dumps(info).encode())
        os.fsync(fd)
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None
