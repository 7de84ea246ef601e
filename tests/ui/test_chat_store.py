"""The chat store (server/chat_store.py) on a real SQLite file: writes from many threads at
once, a damaged file refused with a plain message and left whole, the limits per user, and
one user's chats out of another's reach; and the browser's copy (server/chat_library.py)."""

from __future__ import annotations

import sqlite3
import threading

import pytest

from server.chat_library import BrowserLibrary, StoredLibrary, library_for
from server.chat_store import ChatStore, ChatStoreError
from server.chats import (
    ChatLimitError,
    ChatLimits,
    chats_of_export,
    export_all_json,
    new_chat,
    renamed,
    with_messages,
)
from server.conversation import ConversationError


def chat_saying(text: str, **kwargs) -> dict:
    return with_messages(new_chat(**kwargs), [{"role": "user", "content": text},
                                              {"role": "assistant", "content": "ok"}])


@pytest.fixture
def store(tmp_path) -> ChatStore:
    return ChatStore(tmp_path / "chats.sqlite3")


def test_a_chat_comes_back_whole_with_its_versions_and_title(store):
    chat = chat_saying("What are the modes of this app?")
    chat["messages"][0] |= {"branch": 1, "branches": [[{"role": "user", "content": "old"}]]}
    store.put("ann", chat)
    assert store.get("ann", chat["id"]) == chat
    assert store.summaries("ann") == [{"id": chat["id"], "title": chat["title"],
                                       "updated": chat["updated"]}]
    assert chat["title"] == "What are the modes of this app?"
    again = ChatStore(store.path)  # as after a restart
    assert again.get("ann", chat["id"]) == chat


def test_one_user_never_reaches_another_users_chat(store):
    mine = chat_saying("my secret plan")
    store.put("ann", mine)
    assert store.summaries("bob") == []
    assert store.get("bob", mine["id"]) is None
    assert store.search("bob", "secret") == []
    assert [s["id"] for s in store.search("ann", "secret")] == [mine["id"]]
    # A write of the same id by another user is that user's own chat: ann's stays as it was.
    store.put("bob", {**chat_saying("bob's"), "id": mine["id"]})
    store.delete("bob", mine["id"])
    assert store.get("ann", mine["id"]) == mine
    assert StoredLibrary(store, "bob").summaries() == []


def test_writes_from_many_threads_at_once_all_land_and_the_last_one_per_chat_wins(store):
    shared = new_chat()
    errors: list[BaseException] = []

    def writer(n: int) -> None:
        try:
            for i in range(15):
                store.put("ann", with_messages(shared, [{"role": "user",
                                                         "content": f"t{n} v{i}"}]))
                store.put("ann", chat_saying(f"thread {n} chat {i}"))
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(store.summaries("ann")) == 6 * 15 + 1
    content = store.get("ann", shared["id"])["messages"][0]["content"]
    assert content.endswith("v14")  # some thread's last write
    with sqlite3.connect(store.path) as db:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_a_damaged_file_is_refused_in_plain_words_and_left_whole(tmp_path):
    path = tmp_path / "chats.sqlite3"
    good = ChatStore(path)
    good.put("ann", chat_saying("keep me"))
    with sqlite3.connect(path) as db:
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    data = bytearray(path.read_bytes())
    data[:16] = b"this is not sql\0"  # the header a SQLite file starts with, overwritten
    path.write_bytes(bytes(data))
    with pytest.raises(ChatStoreError) as refused:
        ChatStore(path)
    message = str(refused.value)
    assert "chats.sqlite3 cannot be read" in message and "left as it is" in message
    assert str(tmp_path) not in message and "Traceback" not in message
    assert path.read_bytes() == bytes(data)  # nothing in it was dropped or rewritten


def test_a_file_of_another_program_is_refused(tmp_path):
    path = tmp_path / "other.db"
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE chats (name TEXT)")
    with pytest.raises(ChatStoreError, match="not this app's"):
        ChatStore(path)


def test_limits_per_user_are_refused_with_a_plain_message(tmp_path):
    store = ChatStore(tmp_path / "c.sqlite3",
                      ChatLimits(chats=2, chat_bytes=2000, total_bytes=3000))
    store.put("ann", chat_saying("one"))
    store.put("ann", chat_saying("two"))
    with pytest.raises(ChatLimitError, match="you have 2 chats, the most kept"):
        store.put("ann", chat_saying("three"))
    store.put("bob", chat_saying("bob has his own limits"))  # per user
    with pytest.raises(ChatLimitError, match="a chat may hold at most"):
        store.put("bob", chat_saying("x" * 3000))
    big = chat_saying("y" * 1500)
    store.put("carl", big)
    with pytest.raises(ChatLimitError, match="your chats would take"):
        store.put("carl", chat_saying("z" * 1500))
    store.put("carl", with_messages(big, [{"role": "user", "content": "shorter"}]))
    assert len(store.summaries("ann")) == 2 and len(store.summaries("carl")) == 1


def test_a_row_that_cannot_be_read_stays_listed_and_is_never_dropped(store):
    chat = chat_saying("fine")
    store.put("ann", chat)
    with sqlite3.connect(store.path) as db:
        db.execute("UPDATE chats SET body = '{broken' WHERE id = ?", (chat["id"],))
    assert [s["title"] for s in store.summaries("ann")] == ["fine"]
    with pytest.raises(ChatStoreError, match="cannot be read; it is kept"):
        store.get("ann", chat["id"])
    assert len(store.summaries("ann")) == 1


def test_search_finds_every_word_in_titles_messages_and_versions(store):
    library = StoredLibrary(store, "ann")
    first, second = chat_saying("Tell me about Paris"), chat_saying("and Rome")
    second["messages"][0] |= {"branch": 1,
                              "branches": [[{"role": "user", "content": "Lisbon trams"}]]}
    library.put(first)
    library.put(second)
    assert [s["id"] for s in library.search("paris")] == [first["id"]]
    assert [s["id"] for s in library.search("LISBON trams")] == [second["id"]]
    assert library.search("paris rome") == []
    assert len(library.search("")) == 2
    third = chat_saying('Die "Straße" am Fluss')
    library.put(third)  # words SQLite cannot lower-case, or that JSON escapes
    assert [s["id"] for s in library.search("STRASSE")] == [third["id"]]  # ß folds to ss
    assert [s["id"] for s in library.search("straße")] == [third["id"]]
    assert [s["id"] for s in library.search('"straße"')] == [third["id"]]


def test_presets_per_user(store):
    ann, bob = StoredLibrary(store, "ann"), StoredLibrary(store, "bob")
    ann.put_preset("terse", {"system_prompt": "Be terse.", "settings": {"temperature": 0.1}})
    assert ann.presets() == {"terse": {"system_prompt": "Be terse.",
                                       "settings": {"temperature": 0.1}}}
    assert bob.presets() == {}
    ann.delete_preset("terse")
    assert ann.presets() == {}


def test_the_browsers_copy_drops_what_is_not_a_chat_and_keeps_its_limits():
    good = chat_saying("hello")
    library = BrowserLibrary({"chats": {good["id"]: good, "x": {"id": "../etc"}}},
                             {"p": {"settings": {"temperature": 999}}},
                             ChatLimits(chats=1, chat_bytes=10_000, total_bytes=20_000))
    assert list(library.value()["chats"]) == [good["id"]]
    assert library.presets() == {}  # out of range: not a preset
    with pytest.raises(ChatLimitError):
        library.put(chat_saying("another"))
    with pytest.raises(ConversationError, match="log in"):
        library_for(ChatStore.__new__(ChatStore), None, {})


def test_renaming_and_export_of_all_chats():
    chat = renamed(chat_saying("first message"), "  My   plan ")
    assert chat["title"] == "My plan" and chat["renamed"]
    assert with_messages(chat, [{"role": "user", "content": "other"}])["title"] == "My plan"
    assert renamed(chat, "")["title"] == "first message"
    import json

    back = chats_of_export(json.loads(export_all_json([chat])))
    assert back[0]["title"] == "My plan" and back[0]["id"] != chat["id"]
    assert back[0]["messages"] == chat["messages"]
