"""The chat list of each logged-in user, kept on the server in one SQLite file (--chat-store):
one row per chat (its JSON, versions included) and one per preset, keyed by the user name
the login gave (never by anything the browser sends).

WAL mode, a connection per call and each write in one transaction: two tabs (or two
browsers) of one user writing at once cannot leave a half-written row; the last write of a
chat wins. The limits per user are checked inside the write's transaction, so two writes
cannot both pass a limit that only one fits.

A file that is not a readable chat store is refused when the app starts, and left as it is:
nothing in it is dropped or overwritten. A single row that cannot be read stays listed
under its title and is never deleted by a read.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
from contextlib import closing, contextmanager
from pathlib import Path

from .chats import (
    ChatLimitError,
    ChatLimits,
    chat_bytes,
    chat_json,
    check_fits,
    newest_first,
    search_text,
    search_words,
)
from .presets import MAX_PRESETS

log = logging.getLogger("server")
BUSY_TIMEOUT_S = 10.0
STORE_FILE = "chats.sqlite3"
STORE_LIMITS = ChatLimits()
SCHEMA = """
CREATE TABLE IF NOT EXISTS chats (
    user TEXT NOT NULL, id TEXT NOT NULL, title TEXT NOT NULL, updated REAL NOT NULL,
    bytes INTEGER NOT NULL, body TEXT NOT NULL, search_text TEXT NOT NULL,
    PRIMARY KEY (user, id));
CREATE TABLE IF NOT EXISTS presets (
    user TEXT NOT NULL, name TEXT NOT NULL, body TEXT NOT NULL, PRIMARY KEY (user, name));
"""
COLUMNS = {"chats": {"user", "id", "title", "updated", "bytes", "body", "search_text"},
           "presets": {"user", "name", "body"}}


class ChatStoreError(RuntimeError):
    """The store cannot be used, or a row of it cannot be read; the message says what to do."""


def default_store_path() -> Path:
    """Beside the app's other data (the demo model): $QWEN_CHAT_CACHE or ~/.cache/qwen-chat."""
    root = os.environ.get("QWEN_CHAT_CACHE") or Path.home() / ".cache" / "qwen-chat"
    return Path(root) / STORE_FILE


class ChatStore:
    """Every user's chats and presets in one SQLite file. Every method takes the user."""

    def __init__(self, path: str | Path, limits: ChatLimits = STORE_LIMITS):
        self.path = Path(path).expanduser()
        self.limits = limits
        self._open()

    # -- opening ------------------------------------------------------------------------------
    def _open(self) -> None:
        name = self.path.name
        if self.path.is_dir():
            raise ChatStoreError(f"the chat store {name} is a folder: name a file")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with closing(self._connect()) as db:
                if db.execute("PRAGMA quick_check").fetchone()[0] != "ok":
                    raise sqlite3.DatabaseError("its pages do not check out")
                db.execute("PRAGMA journal_mode=WAL")
                db.executescript(SCHEMA)
                for table, wanted in COLUMNS.items():
                    have = {row[1] for row in db.execute(f"PRAGMA table_info({table})")}
                    if not wanted <= have:
                        raise sqlite3.DatabaseError(f"its {table} table is not this app's")
        except sqlite3.DatabaseError as error:
            raise ChatStoreError(
                f"the chat store {name} cannot be read ({error}); it was left as it is, "
                "with every chat in it: move it aside (or restore a copy) and start again, "
                "or name another file with --chat-store") from None
        except OSError as error:
            raise ChatStoreError(f"the chat store {name} cannot be opened: "
                                 f"{error.strerror or error}") from None
        log.info("chat store: %s", self.path)

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None)
        db.execute(f"PRAGMA busy_timeout={int(BUSY_TIMEOUT_S * 1000)}")
        return db

    @contextmanager
    def _write(self):
        """One write transaction, taken at once (BEGIN IMMEDIATE): the limit checks inside it
        see every other write before or after, never half of one."""
        with closing(self._connect()) as db:
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")

    # -- chats --------------------------------------------------------------------------------
    def summaries(self, user: str) -> list[dict]:
        """{id, title, updated} of the user's chats, newest first."""
        with closing(self._connect()) as db:
            rows = db.execute("SELECT id, title, updated FROM chats WHERE user = ?",
                              (user,)).fetchall()
        return newest_first([{"id": i, "title": t, "updated": u} for i, t, u in rows])

    def get(self, user: str, chat_id: str) -> dict | None:
        """The user's chat, or None when the user has no chat of that id (another user's
        chat of that id is not theirs: None too)."""
        with closing(self._connect()) as db:
            row = db.execute("SELECT title, body FROM chats WHERE user = ? AND id = ?",
                             (user, chat_id)).fetchone()
        if row is None:
            return None
        try:
            chat = json.loads(row[1])
        except ValueError:
            log.error("chat store: chat %s of %s cannot be read; kept as it is", chat_id, user)
            raise ChatStoreError(f"the chat “{row[0]}” cannot be read; it is kept as it is "
                                 "(the server's log says more)") from None
        return chat

    def put(self, user: str, chat: dict) -> None:
        """Keep (or replace) the user's chat; ChatLimitError past the user's limits."""
        body = chat_json(chat)
        with self._write() as db:
            others = db.execute("SELECT id, bytes FROM chats WHERE user = ?",
                                (user,)).fetchall()
            check_fits(chat, others, self.limits)
            db.execute("INSERT OR REPLACE INTO chats (user, id, title, updated, bytes, body, "
                       "search_text) VALUES (?, ?, ?, ?, ?, ?, ?)",
                       (user, chat["id"], chat["title"], float(chat["updated"]),
                        chat_bytes(chat), body, search_text(chat)))

    def delete(self, user: str, chat_id: str) -> None:
        with self._write() as db:
            db.execute("DELETE FROM chats WHERE user = ? AND id = ?", (user, chat_id))

    def search(self, user: str, query: str) -> list[dict]:
        """{id, title, updated} of the user's chats holding every word of `query`, newest
        first: the words as server/chats.matches finds them, in the text kept for search."""
        words = search_words(query)
        sql = ("SELECT id, title, updated FROM chats WHERE user = ?"
               + " AND instr(search_text, ?) > 0" * len(words))
        with closing(self._connect()) as db:
            rows = db.execute(sql, (user, *words)).fetchall()
        return newest_first([{"id": i, "title": t, "updated": u} for i, t, u in rows])

    # -- presets ------------------------------------------------------------------------------
    def presets(self, user: str) -> dict[str, dict]:
        with closing(self._connect()) as db:
            rows = db.execute("SELECT name, body FROM presets WHERE user = ? ORDER BY name",
                              (user,)).fetchall()
        kept = {}
        for name, body in rows:
            try:
                kept[name] = json.loads(body)
            except ValueError:
                log.error("chat store: preset %r of %s cannot be read; kept as it is",
                          name, user)
        return kept

    def put_preset(self, user: str, name: str, preset: dict) -> None:
        with self._write() as db:
            names = {r[0] for r in db.execute("SELECT name FROM presets WHERE user = ?",
                                              (user,))}
            if name not in names and len(names) >= MAX_PRESETS:
                raise ChatLimitError(f"you have {len(names)} presets, the most kept: "
                                     "delete one first")
            db.execute("INSERT OR REPLACE INTO presets (user, name, body) VALUES (?, ?, ?)",
                       (user, name, json.dumps(preset, ensure_ascii=False)))

    def delete_preset(self, user: str, name: str) -> None:
        with self._write() as db:
            db.execute("DELETE FROM presets WHERE user = ? AND name = ?", (user, name))

