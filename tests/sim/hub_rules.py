"""What a less careful Hub store would do, put behind today's seams one at a time: with one of them in place the
Hub world (`hubworld.py`) must report a violation by itself (tests/drive/test_simulation.py). Each is a choice
the kit's Hub store rejects (issue 40):

  40.1-unfenced       commits made without `parent_commit`: nothing stops a runtime taken over from committing
  40.2-one-listing    one tree listing says what the run holds (a listing that misses a file is believed)
  40.3-unread-absent  a file the Hub did not answer for (the client's LocalEntryNotFoundError) counts as absent

and the paths of issue 46 (review 6), each undone:

  46.1-beat-behind-data   the heartbeat is a commit queued behind the commit under way, a checkpoint's upload
                          included (commits went one at a time, the data sent inside them)
  46.1-silent-watch       a watch without the watcher's own commit first: a spell of 429s, in which no runtime
                          commits, looks like a dead holder
  46.3-journal-replaced   the pull replaces the replica's journal with the Hub's copy (a kernel restart's lines
                          not committed yet are lost)
  46.5-final-union        a folder's commit only adds files: final/ after a second export holds the new files
                          beside the old export's
  46.5-archive-on-vm      the export a new one replaces is kept in archive/ on the VM only
  46.7-replica-only       the retention rules judge the checkpoints that have reached a new VM's replica, not
                          those still on their way from the Hub (never deleted while the Hub refuses downloads)
"""

from __future__ import annotations

from colab_kit.drive.gate import CheckpointGate
from colab_kit.hub.repo import HubRepo, HubUnavailable
from colab_kit.hub.store import HubStore

__all__ = ["HUB_RULES"]


def unfenced_commits(patch) -> None:
    commit = HubRepo.commit

    def unfenced(self, message, *, parent, add=None, delete=(), sent=()):
        return commit(self, message, parent=None, add=add, delete=delete, sent=sent)

    patch(HubRepo, "commit", unfenced)


def one_listing(patch) -> None:
    def pull(self) -> int:
        listing = self.repo.listing(self.folder, revision=self.lease.head)
        wanted = [p for p, listed in listing.items() if p != self.lease.path and not self._same_locally(p, listed)]
        if wanted:
            from colab_kit.checkpoints import storage

            staging = self.replica.parent / f".pull-{self.replica.name}"
            self.repo.download(wanted, staging, revision=self.lease.head)
            for path in wanted:
                target = self.replica / path[len(self.folder) + 1:]
                storage.make_dirs(target.parent)
                storage.replace(staging / path, target)
            storage.remove_tree(staging)
        return len(wanted)

    patch(HubStore, "pull", pull)


def unread_is_absent(patch) -> None:
    read = HubRepo.read

    def absent(self, path, revision=None):
        try:
            return read(self, path, revision)
        except HubUnavailable:
            return None

    patch(HubRepo, "read", absent)


def beat_behind_data(patch) -> None:
    from colab_kit.hub.lease import HubLease

    commit, step = HubLease.commit, HubLease.step

    def one_at_a_time(self, message, *, add=None, delete=()):
        self.in_commit = True
        try:
            return commit(self, message, add=add, delete=delete)
        finally:
            self.in_commit = False

    def queued(self, on_lost, on_error=None):
        if getattr(self, "in_commit", False):
            return not self.lost  # the beat waits for the commit under way (its thread blocks on the lock)
        return step(self, on_lost, on_error)

    patch(HubLease, "commit", one_at_a_time)
    patch(HubLease, "step", queued)


def silent_watch(patch) -> None:
    from colab_kit.hub import leasewatch

    patch(leasewatch, "announce", lambda lease, previous, run_name: lease.repo.head())


def journal_replaced(patch) -> None:
    from colab_kit.checkpoints import storage

    patch(HubStore, "_merge_journal", staticmethod(lambda hubs, replicas: storage.replace(hubs, replicas)))


def final_union(patch) -> None:
    confirm = HubStore.confirm

    def adds_only(self, folder, manifest, *, push=True):
        commit = self.lease.commit
        self.lease.commit = lambda message, add=None, delete=(): commit(message, add=add)
        try:
            return confirm(self, folder, manifest, push=push)
        finally:
            del self.lease.commit

    patch(HubStore, "confirm", adds_only)


def archive_on_vm(patch) -> None:
    patch(HubStore, "_archive_unsent", lambda self: {})


def replica_only(patch) -> None:
    patch(CheckpointGate, "elsewhere", lambda self: {})
    patch(CheckpointGate, "in_cloud_elsewhere", lambda self: set())


HUB_RULES = {"40.1-unfenced": unfenced_commits, "40.2-one-listing": one_listing, "40.3-unread-absent": unread_is_absent,
             "46.1-beat-behind-data": beat_behind_data, "46.1-silent-watch": silent_watch,
             "46.3-journal-replaced": journal_replaced, "46.5-final-union": final_union,
             "46.5-archive-on-vm": archive_on_vm, "46.7-replica-only": replica_only}
