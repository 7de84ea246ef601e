"""The app's logins: those given with --auth, and those of --auth-file, read again whenever the
file changes. A user removed from the file is refused at the next request (their page session
is ended: request guard, guards.py) and an added one can log in, without a restart.

Whether the file changed is one stat() per check (its size, modification time and inode: an
editor that saves by replacing the file gives a new inode), so it is checked on every login
and every request that carries a login. Iterating a Logins gives the current (user, password)
pairs; `bool(logins)` says whether logins are on at all, which stays true even when the file is
emptied, so that the app never opens up to everyone because a file was edited.
"""

from __future__ import annotations

import hmac
import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger("ui")


def parse_logins(text: str, where: str) -> tuple[list[tuple[str, str]], list[str]]:
    """The (user, password) pairs of a logins file's text and, for each bad line, a problem
    ("WHERE line N: expected user:password"). Blank lines and # comments are skipped."""
    logins, problems = [], []
    for number, line in enumerate(text.splitlines(), 1):
        value = line.strip()
        if not value or value.startswith("#"):
            continue
        user, sep, password = value.partition(":")
        if not sep or not user or not password:
            problems.append(f"{where} line {number}: expected user:password")
            continue
        logins.append((user, password))
    return logins, problems


class Logins:
    """The --auth pairs (fixed) and the --auth-file pairs (followed)."""

    def __init__(self, fixed: list[tuple[str, str]], file: str | Path | None = None,
                 file_logins: list[tuple[str, str]] | None = None):
        self.fixed = list(fixed)
        self.file = Path(file) if file else None
        self._from_file = list(file_logins or [])
        self._seen = self._stamp()
        self._lock = threading.Lock()

    def __bool__(self) -> bool:  # logins are on: never off because the file was emptied
        return bool(self.fixed) or self.file is not None

    def __iter__(self) -> Iterator[tuple[str, str]]:
        return iter(self.current())

    def current(self) -> list[tuple[str, str]]:
        self.refresh()
        return self.fixed + self._from_file

    def users(self) -> set[str]:
        return {user for user, _ in self.current()}

    def check(self, user: str, password: str) -> bool:
        """gradio's auth callable. Every login is compared, so the time taken does not tell
        which user exists."""
        found = False
        for known_user, known_password in self.current():
            found |= hmac.compare_digest(f"{user}:{password}".encode(),
                                         f"{known_user}:{known_password}".encode())
        return found

    def refresh(self) -> bool:
        """Read the file again if it changed since it was last read; True if it was."""
        if self.file is None or self._stamp() == self._seen:
            return False
        with self._lock:
            stamp = self._stamp()
            if stamp == self._seen:  # another thread read it meanwhile
                return False
            before = {user for user, _ in self._from_file}
            try:
                text = self.file.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as error:
                # Gone or unreadable: its users are refused until it can be read again.
                log.warning("logins file %s cannot be read (%s): its users are refused until "
                            "it can", self.file, getattr(error, "strerror", None) or error)
                self._from_file, self._seen = [], stamp
                return True
            logins, problems = parse_logins(text, str(self.file))
            for problem in problems:
                log.warning("logins file: %s (line skipped)", problem)
            self._from_file, self._seen = logins, stamp
            after = {user for user, _ in logins}
            log.info("logins file %s read again: %d users; added %s, removed %s", self.file,
                     len(after), sorted(after - before) or "none",
                     sorted(before - after) or "none")
            return True

    def _stamp(self) -> tuple | None:
        if self.file is None:
            return None
        try:
            info = os.stat(self.file)
        except OSError:
            return ("missing",)
        return info.st_size, info.st_mtime_ns, info.st_ino
