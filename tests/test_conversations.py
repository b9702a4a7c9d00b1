"""Conversation loading: shapes, bad input reported with its location, nothing good lost."""

from __future__ import annotations

import json

import pytest

from specfoundry.conversations.records import ConversationFormatError
from specfoundry.conversations.sources import load_conversations
from tests.conftest import CHAT, write_jsonl

GOOD_OPENAI = {"id": "g1", "messages": [
    {"role": "system", "content": "sys"}, {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
GOOD_SHAREGPT = {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}

# (line content, expected kind); the good records sit between the bad ones on purpose.
BAD_LINES = [
    ('{"messages": [{"role": "user", "content": "q"', "malformed_json"),
    (json.dumps({"messages": [{"content": "q"}, {"role": "assistant", "content": "a"}]}), "missing_role"),
    (json.dumps({"messages": []}), "empty_conversation"),
    (json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                              {"role": "user", "content": "and?"}]}), "ends_on_user"),
    (json.dumps({"messages": [{"role": "narrator", "content": "q"}, {"role": "assistant", "content": "a"}]}),
     "unknown_role"),
    (json.dumps({"messages": [{"role": "user", "content": None}, {"role": "assistant", "content": "a"}]}),
     "missing_content"),
    ("[1, 2, 3]", "malformed_json"),
]


def write_mixed(path):
    lines = [json.dumps(GOOD_OPENAI)]
    for text, _ in BAD_LINES:
        lines.append(text)
        lines.append(json.dumps(GOOD_SHAREGPT))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_every_bad_kind_is_reported_with_its_line_and_good_ones_kept(tmp_path):
    path = write_mixed(tmp_path / "mixed.jsonl")
    result = load_conversations(path)
    assert len(result.conversations) == 1 + len(BAD_LINES)
    # bad line k sits at line 2 + 2k (line 1 is the first good record)
    expected = [(f"{path}:{2 + 2 * k}", kind) for k, (_, kind) in enumerate(BAD_LINES)]
    assert [(b.location, b.kind) for b in result.bad] == expected
    first = result.conversations[0]
    assert first.id == "g1" and [m.role for m in first.messages] == ["system", "user", "assistant"]
    assert [m.role for m in result.conversations[1].messages] == ["user", "assistant"]


def test_the_details_name_the_column_the_part_and_the_field(tmp_path):
    """The column of a line's JSON error is that of the line, not of its newline; a non-text
    content part and a 'messages' that is no list are named as what they are."""
    unclosed = '{"messages": [{"role": "user", "content": "q"}]'
    parts = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
                          {"role": "assistant", "content": "a"}]}
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join([unclosed, json.dumps(parts), json.dumps({"messages": "hello"})]) + "\n")
    details = [b.detail for b in load_conversations(path).bad]
    assert details == [f"malformed JSON (Expecting ',' delimiter at column {len(unclosed) + 1})",
                       "turn 0: content part 0 is of type 'image_url', not a text part ({\"type\": \"text\", "
                       "\"text\": ...}): only text is trained on",
                       "'messages' is a str, not a list of turns"]


def test_openai_content_parts_of_text_are_one_text(tmp_path):
    record = {"messages": [{"role": "user", "content": [{"type": "text", "text": "first"},
                                                         {"type": "text", "text": "second"}]},
                           {"role": "assistant", "content": [{"type": "text", "text": "a"}]}]}
    path = tmp_path / "parts.jsonl"
    path.write_text(json.dumps(record) + "\n")
    (conv,) = load_conversations(path).conversations
    assert [m.content for m in conv.messages] == ["first\nsecond", "a"]


def test_strict_fails_on_the_first_bad_record(tmp_path):
    path = write_mixed(tmp_path / "mixed.jsonl")
    with pytest.raises(ConversationFormatError, match=rf"{path.name}:2: malformed_json"):
        load_conversations(path, strict=True)


def test_folder_of_json_and_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "a.json").write_text(json.dumps([GOOD_OPENAI, GOOD_SHAREGPT]))
    pq.write_table(pa.Table.from_pylist([{**GOOD_OPENAI, "id": "g2"}]), tmp_path / "b.parquet")
    result = load_conversations(tmp_path)
    assert [c.location.split("/")[-1] for c in result.conversations] == ["a.json:row 0", "a.json:row 1", "b.parquet:row 0"]
    assert not result.bad


def test_a_linked_folder_in_a_source_is_read_and_a_link_loop_is_refused(tmp_path):
    """issue 61 item 7: a folder reached through a symbolic link was skipped without a word (a
    linked file was read)."""
    from specfoundry.conversations.sources import data_files

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    write_jsonl(elsewhere / "more.jsonl", CHAT)
    source = tmp_path / "source"
    source.mkdir()
    write_jsonl(source / "chat.jsonl", CHAT)
    (source / "linked").symlink_to(elsewhere, target_is_directory=True)
    assert [p.name for p in data_files(source)] == ["chat.jsonl", "more.jsonl"]
    (elsewhere / "back").symlink_to(source, target_is_directory=True)
    with pytest.raises(ConversationFormatError, match=r"back links back to .*source, a folder being read"):
        data_files(source)


def test_a_lone_surrogate_escape_is_that_records_bad_input(tmp_path):
    """issue 61 item 10: JSON's "\\ud800" decodes to a string no tokenizer encodes; sf-capture, sf-regen
    and sf-eval died with a tokenizer traceback. The record is now bad input, the others kept."""
    path = tmp_path / "s.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": "hi \\ud800 there"}, {"role": "assistant", '
                    '"content": "ok"}]}\n' + json.dumps({"messages": CHAT[0]["messages"]}) + "\n")
    result = load_conversations(path)
    assert len(result.conversations) == 1
    assert [(b.location, b.kind) for b in result.bad] == [(f"{path}:1", "invalid_utf8")]
    assert "turn 0: content holds a lone surrogate escape (\\ud800 at character 3)" in result.bad[0].detail
