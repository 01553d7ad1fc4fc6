"""The store contract (docs/stores.md), case by case, on every store (tests/stores/conftest.py: a plain folder, the
DriveFS emulator with and without attributes, the Drive API, the emulated Hub).

Each case trains the tiny BERT through the public face (start_run, run.train, run.save_final, run.finish,
`python -m colab_kit status`) and judges what the store itself holds, never the VM's copy: a store that keeps
its promise only on the VM fails here. The Hub's own faults (commits slower than the lease's watch window,
429s, answers lost) are in tests/hub; Drive's (errors, stalls, listings that miss entries) in tests/drive.
"""

import json
import re

import pytest

from colab_kit.__main__ import main
from colab_kit.checkpoints.journal import read_events
from colab_kit.tasks.demo import tiny_trainer

pytestmark = pytest.mark.slow


def manifest_of(files: dict[str, bytes]) -> dict:
    return json.loads(files["MANIFEST.json"])


def train(run, steps: int, **kwargs):
    trainer = tiny_trainer(run, max_steps=steps, **kwargs)
    run.train(trainer)
    return trainer


def test_every_checkpoint_is_whole_in_the_store_and_a_new_vm_resumes_from_the_newest(store):
    run = store.start("whole", store.new_vm())
    train(run, 10)
    summary = run.finish(timeout=120)
    assert summary["in_cloud"] is store.proof, summary
    assert 10 in store.checkpoints("whole"), store.checkpoints("whole")

    # The journal, as the store holds it, says a checkpoint is safe only on the store's proof (on a plain
    # folder, written and verified is safe), and the newest it says so of is whole there.
    claimed = {e["step"] for e in store.journal("whole") if e["event"] == "cloud" and "step" in e}
    if store.proof is False:
        assert not claimed, claimed
    else:
        assert claimed and max(claimed) == 10 and 10 in store.checkpoints("whole"), claimed

    again = store.start("whole", store.new_vm())  # /content wiped: a new VM resumes from the store
    try:
        assert again.resume_from is not None and again.resume_from.name == "checkpoint-10", again.resume_from
    finally:
        again.finish(timeout=60)


def test_a_new_export_replaces_final_whole_and_the_old_one_is_kept_in_the_store(store):
    run = store.start("export", store.new_vm())
    trainer = train(run, 5)
    run.save_final(trainer.model, metrics={"accuracy": 0.5})
    assert "metrics.json" in store.final("export") or store.kind == "hub"  # the Hub commits it at finish
    run.save_final(trainer.model)  # exported again, without metrics
    summary = run.finish(timeout=120)
    assert summary["in_cloud"] is store.proof, summary

    final = store.final("export")
    assert "metrics.json" not in final, sorted(final)  # swapped whole: never the union of two exports
    assert set(final) == set(manifest_of(final)["files"]) | {"MANIFEST.json"}, sorted(final)
    archived = store.archived_finals("export")
    assert len(archived) == 1 and "metrics.json" in archived[0], [sorted(a) for a in archived]


def test_the_journal_in_the_store_holds_every_line_of_each_process_in_order(store):
    vm = store.new_vm()
    first = store.start("journal", vm)
    train(first, 5)
    first.finish(timeout=120)
    second = store.start("journal", vm)  # a kernel restart: the same VM, its local copy of the journal kept
    assert second.resume_from is not None and second.resume_from.name == "checkpoint-5"
    train(second, 10)
    second.finish(timeout=120)

    held = store.journal("journal")
    journal = second.journal
    local = read_events(journal.local_copy or journal.path)  # every line this VM wrote
    starts = [i for i, e in enumerate(held) if e["event"] == "start"]
    finishes = [i for i, e in enumerate(held) if e["event"] == "finish"]
    assert len(starts) == 2 and len(finishes) == 2, [e["event"] for e in held]
    assert starts[0] < finishes[0] < starts[1] < finishes[1], [e["event"] for e in held]
    assert held == local  # none lost (the last ones included), none twice, none replaced by an older copy


def test_finished_means_everything_is_in_the_store_and_the_lease_released(store, capsys):
    run = store.start("done", store.new_vm())
    trainer = train(run, 10)
    run.save_final(trainer.model, metrics={"accuracy": 1.0})
    summary = run.finish(timeout=120)
    assert summary["status"] == "completed" and summary["synced"], summary  # run.train completed the run
    assert summary["in_cloud"] is store.proof, summary

    final = store.final("done")
    manifest = manifest_of(final)
    assert set(manifest["files"]) <= set(final)
    journal = run.journal
    assert store.journal("done") == read_events(journal.local_copy or journal.path)  # the last lines too
    lease = store.lease("done")
    assert lease is not None and lease.released, lease

    # status, read from the store, agrees
    code = main(["status", store.address("done")])
    said = capsys.readouterr()
    said = said.out + said.err
    assert code == 0, said
    assert "resume would use: checkpoint-10" in said and "released" in said, said

    # The run folder explains itself to a person (clause 9): the last page the runtime wrote says the same.
    files = store.files("done")
    page = files["STATUS.md"].decode()
    assert page.startswith("# Run `done`: finished\n") and re.search(r"^\| step \| 10\b", page, re.M), page
    cloud = "checkpoint-10, saved" if store.proof is not False else "none yet"  # no proof, no claim
    assert f"| newest in the cloud | {cloud}" in page, page
    assert files["status.png"].startswith(b"\x89PNG\r\n\x1a\n")
