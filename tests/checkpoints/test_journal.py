import errno
import json

from colab_kit.checkpoints.journal import Journal, read_events


def test_events_are_appended_one_json_object_per_line(drive):
    journal = Journal(drive / "events.jsonl")
    journal.write("start", run="x")
    journal.write("save", step=10)
    lines = (drive / "events.jsonl").read_text().splitlines()
    assert [json.loads(line)["event"] for line in lines] == ["start", "save"]
    assert read_events(drive / "events.jsonl")[1]["step"] == 10


def test_a_torn_last_line_is_mended_and_skipped(drive):
    path = drive / "events.jsonl"
    path.write_text('{"event": "start", "time": 1}\n{"event": "sa')  # killed mid-append
    Journal(path).write("resume", step=10)
    assert [e["event"] for e in read_events(path)] == ["start", "resume"]


def test_lines_wait_while_drive_fails_and_land_in_order(drive, drive_faults, tmp_path):
    journal = Journal(drive / "events.jsonl", local_copy=tmp_path / "local.jsonl")
    journal.write("start")
    drive_faults.fail(errno.EIO)
    journal.write("save", step=1)
    journal.write("warn", what="sync_failed")
    assert journal.pending == 2
    assert [e["event"] for e in read_events(tmp_path / "local.jsonl")] == ["start", "save", "warn"]
    drive_faults.heal()
    journal.write("sync", step=1)
    assert journal.pending == 0
    assert [e["event"] for e in read_events(drive / "events.jsonl")] == ["start", "save", "warn", "sync"]
