"""The versions of a conversation (server/branches.py) and their checks on import (pure
functions: no app needed)."""

from __future__ import annotations

import copy
import json

import pytest

from server.branches import (
    branch_points,
    current_path,
    fork,
    page,
    pick_point,
    reply_point,
    seen_state,
    switch_branch,
    tree_size,
    versions,
)
from server.conversation import (
    MAX_BRANCH_DEPTH,
    ConversationError,
    engine_messages,
    export_json,
    import_json,
    turn_of_view,
    validate_history,
)


def user(text):
    return {"role": "user", "content": text}


def bot(text, **extra):
    return {"role": "assistant", "content": text, **extra}


THREE_TURNS = [user("one"), bot("1"), user("two"), bot("2"), user("three"), bot("3")]


def contents(conversation):
    return [m["content"] for m in conversation]


def test_editing_a_message_keeps_the_replaced_turns_as_the_earlier_version():
    original = copy.deepcopy(THREE_TURNS)
    edited = fork(THREE_TURNS, 2, [user("TWO")])
    assert THREE_TURNS == original  # never changed in place
    assert contents(edited) == ["one", "1", "TWO"]
    assert branch_points(edited)[0].position == "2 / 2"
    back = switch_branch(edited, 2, 0)
    # The earlier version comes back whole: the message and every turn after it.
    assert current_path(back) == THREE_TURNS
    assert branch_points(back)[0].position == "1 / 2"
    assert current_path(switch_branch(back, 2, 1)) == current_path(edited)


def test_a_third_version_comes_last_and_paging_stops_at_the_ends():
    conversation = fork(fork(THREE_TURNS, 2, [user("TWO"), bot("II")]), 2, [user("deux")])
    assert [p.position for p in branch_points(conversation)] == ["3 / 3"]
    assert contents(page(conversation, 2, +1)) == contents(conversation)  # at the end
    middle = page(conversation, 2, -1)
    assert contents(middle) == ["one", "1", "TWO", "II"]
    first = page(middle, 2, -1)
    assert contents(first) == contents(THREE_TURNS)
    assert contents(page(first, 2, -1)) == contents(THREE_TURNS)
    assert [contents(v) for v in versions(first, 2)] == [
        ["two", "2", "three", "3"], ["TWO", "II"], ["deux"]]


def test_regenerate_adds_a_reply_version_after_the_last_user_message():
    at = reply_point(THREE_TURNS)
    assert at == 5
    again = fork(THREE_TURNS, at, [bot("3, again")])
    assert contents(again)[-1] == "3, again"
    assert branch_points(again)[0].role == "assistant"
    assert contents(switch_branch(again, 5, 0)) == contents(THREE_TURNS)
    assert reply_point([]) is None
    # No reply yet (it failed): the new one is simply added.
    assert fork(THREE_TURNS[:5], 5, [bot("x")]) == [*THREE_TURNS[:5], bot("x")]


def test_versions_further_down_travel_with_their_branch():
    later = fork(THREE_TURNS, 4, [user("THREE")])            # a version at message 4
    earlier = fork(later, 2, [user("TWO")])                  # then one at message 2
    assert [p.index for p in branch_points(earlier)] == [2]
    back = switch_branch(earlier, 2, 0)
    assert [(p.index, p.position) for p in branch_points(back)] == [(2, "1 / 2"), (4, "2 / 2")]
    assert contents(switch_branch(back, 4, 0)) == contents(THREE_TURNS)
    assert tree_size(earlier) == len(THREE_TURNS) + 2


def test_the_model_is_sent_the_current_path_only():
    conversation = fork(THREE_TURNS, 2, [user("TWO")])
    sent = engine_messages(conversation)
    assert sent == [user("one"), bot("1"), user("TWO")]
    assert "branches" not in json.dumps(sent)


def test_branches_survive_validation_export_and_import():
    conversation = fork(fork(THREE_TURNS, 2, [user("TWO"), bot("II", stats="9 ms")]), 3,
                        [bot("2, again")])
    assert validate_history(conversation) == conversation
    turns, prompt = import_json(export_json(conversation, "Be brief."))
    assert turns == conversation and prompt == "Be brief."
    assert current_path(switch_branch(turns, 2, 0)) == THREE_TURNS


@pytest.mark.parametrize(("branches", "branch", "expected"), [
    ("x", 0, "branches must be a list of non-empty message lists"),
    ([[]], 0, "branches must be a list of non-empty message lists"),
    ([[bot("a")]], 0, "a version of a user message must be a user message"),
    ([[user("a")]], 2, "branch must be a number from 0 to 1"),
    ([[user("a")]], True, "branch must be a number from 0 to 1"),
    ([[user("a"), {"role": "user", "content": 5}]], 1,
     "message 2, version 1, message 1: content must be a string"),
    ([[{**user("a"), "branches": [[user("b")]], "branch": 0}]], 1,
     "its versions belong to the message shown"),
])
def test_broken_versions_are_refused_with_where_they_are(branches, branch, expected):
    conversation = [user("one"), bot("1"), {**user("two"), "branches": branches,
                                            "branch": branch}]
    with pytest.raises(ConversationError, match=expected):
        validate_history(conversation)


def test_versions_nested_too_deep_are_refused():
    conversation = [user("x")]
    for _ in range(MAX_BRANCH_DEPTH + 1):
        conversation = [{**user("y"), "branches": [[user("old"), *conversation]],
                         "branch": 1}]
    with pytest.raises(ConversationError, match="nested more than"):
        validate_history(conversation)


def test_chatbot_message_numbers_map_to_turns():
    conversation = [user("a"), bot("b", reasoning="r"), user("c"), bot("d")]
    # The chatbot draws: a, the reasoning, b, c, d.
    assert [turn_of_view(conversation, i) for i in range(6)] == [0, 1, 1, 2, 3, None]


def test_the_pager_shows_a_new_version_and_otherwise_stays():
    edited = fork(THREE_TURNS, 4, [user("THREE")])
    points = branch_points(edited)
    assert pick_point(points, None, None, tree_size(edited)) == 4
    seen = seen_state(points, tree_size(edited))
    both = fork(edited, 2, [user("TWO")])
    back = switch_branch(both, 2, 0)
    # Paging at 2 brings back the point at 4: the pager stays where it is paged.
    assert pick_point(branch_points(back), 2, seen_state(branch_points(both), tree_size(both)),
                      tree_size(back)) == 2
    # A new version at 2 while the pager showed 4: it shows the new one.
    again = fork(back, 2, [user("deux")])
    assert pick_point(branch_points(again), 4, seen_state(branch_points(back), tree_size(back)),
                      tree_size(again)) == 2
    # A plain new turn: the pager stays.
    longer = [*again, bot("x")]
    assert pick_point(branch_points(longer), 2, seen, tree_size(longer)) == 2
    assert pick_point([], 2, seen, 0) is None
