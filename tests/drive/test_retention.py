"""Retention: what may be deleted, given what is valid and what is in the cloud."""

import os
import time

from test_checkpoint import make_checkpoint

from colab_kit.drive.drivefs import DRIVEFS, PLAIN, UNCONFIRMED
from colab_kit.drive.retention import UNCONFIRMED_SETTLE_S, choose_doomed, prunable


def test_prune_on_written_state_keeps_newest_valid_ones_and_removes_invalid():
    # A plain folder: written and read back counts as safe, so every valid checkpoint is "safe".
    steps, valid = [10, 20, 30, 35, 40, 50], {10, 20, 30, 40}  # 35 and 50: crashed uploads
    assert prunable(steps, valid, safe=valid, keep=2) == [10, 20, 35, 50]


def test_prune_keeps_the_newest_in_the_cloud_and_whatever_is_on_its_way():
    # 30 is the newest in the cloud; 40 and 50 are written but still uploading.
    steps = [10, 20, 30, 40, 50]
    assert prunable(steps, set(steps), safe={10, 20, 30}, keep=2) == [10]
    # keep counts checkpoints in the cloud: with keep=1 only 30 of them stays, plus the two on their way
    assert prunable(steps, set(steps), safe={10, 20, 30}, keep=1) == [10, 20]


def test_prune_deletes_nothing_before_anything_is_in_the_cloud():
    # The rule before 0.2 deleted 10 and 20 here, and a disconnect then left no checkpoint in the cloud.
    assert prunable([10, 20, 30, 40], {10, 20, 30, 40}, safe=set(), keep=1) == []


def test_prune_removes_what_a_newer_cloud_checkpoint_supersedes_and_honours_protect():
    # 20 was written but never confirmed, and 30 is in the cloud: 20 is no longer needed.
    assert prunable([10, 20, 30], {10, 20, 30}, safe={10, 30}, keep=2) == [20]
    assert prunable([10, 20, 30], {10, 20, 30}, safe={10, 30}, keep=1, protect={10}) == [20]
    # a folder that no longer verifies is garbage even if it once reached the cloud; 10 stays
    assert prunable([10, 20], {10}, safe={10, 20}, keep=1) == [20]


def test_the_best_checkpoint_survives_keep_1_and_takes_one_of_the_keep_places():
    steps = [10, 20, 30, 40]
    # keep=1: the newest (resume) and the best (load_best_model_at_end) both stay, as in the Trainer
    assert prunable(steps, set(steps), safe=set(steps), keep=1, best=10) == [20, 30]
    # keep=3: the best counts against keep, so two more of the newest stay with it
    assert prunable(steps, set(steps), safe=set(steps), keep=3, best=10) == [20]
    # the best still uploading is kept (and does not count: keep counts what is in the cloud)
    assert prunable(steps, set(steps), safe={20, 30}, keep=1, best=10) == [20]
    # once no longer the best, it goes like any other
    assert prunable(steps, set(steps), safe=set(steps), keep=1, best=40) == [10, 20, 30]
    # a broken folder is no best checkpoint
    assert prunable(steps, {20, 30, 40}, safe={20, 30, 40}, keep=1, best=10) == [10, 20, 30]


def test_choose_doomed_protects_the_best_checkpoint(tmp_path):
    for step in (10, 20, 30):
        make_checkpoint(tmp_path, step)
    doomed = choose_doomed(tmp_path, kind=PLAIN, prune_after="cloud", confirmed=set(), keep=1, protect=set(), best=10)
    assert [s for s, _ in doomed] == [20]
    doomed = choose_doomed(tmp_path, kind=DRIVEFS, prune_after="cloud", confirmed={10, 30}, keep=1, protect=set(),
                           best=10)
    assert [s for s, _ in doomed] == [20]


def test_choose_doomed_reads_the_folder_and_applies_the_rule_of_its_kind(tmp_path):
    for step in (10, 20, 30):
        make_checkpoint(tmp_path, step)
    make_checkpoint(tmp_path, 40, manifest=False)  # an upload killed half-way
    steps = lambda doomed: [s for s, _ in doomed]  # noqa: E731
    # plain folder: written is safe
    assert steps(choose_doomed(tmp_path, kind=PLAIN, prune_after="cloud", confirmed=set(), keep=1,
                               protect=set())) == [10, 20, 40]
    # Drive with attributes: only what is confirmed counts; nothing confirmed, nothing deleted
    assert choose_doomed(tmp_path, kind=DRIVEFS, prune_after="cloud", confirmed=set(), keep=1, protect=set()) == []
    assert steps(choose_doomed(tmp_path, kind=DRIVEFS, prune_after="cloud", confirmed={20}, keep=1,
                               protect={40})) == [10]
    # the rule before 0.2: written is safe, on Drive too
    assert steps(choose_doomed(tmp_path, kind=DRIVEFS, prune_after="written", confirmed=set(), keep=1,
                               protect=set())) == [10, 20, 40]
    # folders already being deleted are left to their deletion
    assert steps(choose_doomed(tmp_path, kind=PLAIN, prune_after="cloud", confirmed=set(), keep=1, protect=set(),
                               deleting=[tmp_path / "checkpoint-10"])) == [20, 40]


def test_without_attributes_the_newest_long_written_checkpoint_is_kept_back(tmp_path):
    for step in (10, 20, 30):
        make_checkpoint(tmp_path, step)
    old = time.time() - UNCONFIRMED_SETTLE_S - 60
    os.utime(tmp_path / "checkpoint-10" / "MANIFEST.json", (old, old))  # written 11 minutes ago
    doomed = choose_doomed(tmp_path, kind=UNCONFIRMED, prune_after="cloud", confirmed=set(), keep=1, protect=set())
    assert [s for s, _ in doomed] == [20]  # 30: the newest; 10: most likely uploaded by now
