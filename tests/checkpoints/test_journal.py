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


def events_of(path):
    return [(e["event"], e.get("step")) for e in read_events(path)]


def test_lines_an_earlier_process_left_unsent_go_first_at_the_next_start(drive, drive_faults, tmp_path):
    """A kernel restart while Drive failed (issue 46, path 3 on a folder): the lines written since, a cloud
    confirmation among them, were on the VM's local copy only, and the next process's journal never sent
    them. Now its first flush sends them, before its own, and never twice."""
    path, local = drive / "events.jsonl", tmp_path / "local.jsonl"
    first = Journal(path, local_copy=local)
    first.write("start")
    drive_faults.fail(errno.EIO)
    first.write("sync", step=10)
    first.write("cloud", step=10)  # the process ends here: these two are on the local copy only
    drive_faults.heal()
    assert events_of(path) == [("start", None)]
    second = Journal(path, local_copy=local)
    second.write("start")
    second.write("save", step=20)
    assert events_of(path) == [("start", None), ("sync", 10), ("cloud", 10), ("start", None), ("save", 20)]
    assert len(path.read_text().splitlines()) == 5  # nothing sent twice
    Journal(path, local_copy=local).write("resume", step=20)  # a third process: nothing left to catch up
    assert events_of(path)[-2:] == [("save", 20), ("resume", 20)] and len(read_events(path)) == 6


def test_a_line_written_while_the_first_flush_catches_up_is_sent_once(drive, tmp_path, monkeypatch):
    """The mirror's thread runs the first flush while the main thread writes `start`: the line is on the local
    copy and not yet queued when the flush reads the local copy (a CI run journaled two starts for one)."""
    import colab_kit.checkpoints.journal as journal_module

    path, local = drive / "events.jsonl", tmp_path / "local.jsonl"
    Journal(path, local_copy=local).write("start")
    journal = Journal(path, local_copy=local)
    append = journal_module.storage.append_line

    def append_then_flush(where, line):  # the flusher's turn comes right after the local append
        append(where, line)
        if where == local:
            journal.flush()

    monkeypatch.setattr(journal_module.storage, "append_line", append_then_flush)
    journal.write("start")
    journal.flush()
    assert [e["event"] for e in read_events(path)] == ["start", "start"]


def test_two_threads_writing_at_once_leave_one_order_on_the_vm_and_in_the_folder(drive, tmp_path, monkeypatch):
    """The training loop writes `resume` while the mirror's thread writes `cloud`: the local copy and the
    persistent journal must hold them in the same order (catching up after a kill matches the two; the
    conformance suite saw them swapped on a plain folder)."""
    import threading

    import colab_kit.checkpoints.journal as journal_module

    path, local = drive / "events.jsonl", tmp_path / "local.jsonl"
    journal = Journal(path, local_copy=local)
    journal.on_pending = lambda: None  # the lines wait for a flusher (the mirror's thread), flushed below
    append = journal_module.storage.append_line
    other_done = threading.Event()
    other = threading.Thread(target=lambda: (journal.write("cloud", step=5), other_done.set()))

    def append_then_yield(where, line):  # the other thread's turn comes right after this local append
        append(where, line)
        if where == local and '"resume"' in line:
            other.start()
            other_done.wait(0.5)

    monkeypatch.setattr(journal_module.storage, "append_line", append_then_yield)
    journal.write("resume", step=5)
    other.join(5)
    assert journal.flush()
    assert [e["event"] for e in read_events(path)] == [e["event"] for e in read_events(local)] == ["resume", "cloud"]


def test_a_journal_another_runtime_wrote_last_or_a_folder_made_anew_gets_none_of_the_local_lines(drive, tmp_path):
    path, local = drive / "events.jsonl", tmp_path / "local.jsonl"
    Journal(path, local_copy=local).write("start")
    local.write_text(local.read_text() + json.dumps({"event": "cloud", "step": 10, "time": 2}) + "\n")
    path.write_text(path.read_text() + json.dumps({"event": "start", "host": "other", "time": 3}) + "\n")
    Journal(path, local_copy=local).write("warn", what="x")  # the other runtime's line is the last: not ours
    assert ("cloud", 10) not in events_of(path)
    path.unlink()  # deleted by hand; the run's folder is made anew
    Journal(path, local_copy=local).write("start")
    assert events_of(path) == [("start", None)]


def test_merging_two_copies_of_a_journal_keeps_every_line_once():
    from colab_kit.checkpoints.journal import merge_journals

    hub = b'{"event": "start", "time": 1}\n{"event": "sync", "step": 5, "time": 2}\n'
    replica = hub + b'{"event": "cloud", "step": 5, "time": 3}\n{"event": "sa'  # newer, torn at its end
    assert merge_journals(hub, replica) == hub + b'{"event": "cloud", "step": 5, "time": 3}\n'
    other = hub + b'{"event": "start", "host": "b", "time": 4}\n'  # another runtime appended on the store
    merged = [json.loads(line)["time"] for line in merge_journals(other, replica).splitlines()]
    assert merged == [1, 2, 4, 3]  # the store's order, then the lines it lacks; readers order by time
