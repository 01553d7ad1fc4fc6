"""What a less careful Hub store would do, put behind today's seams one at a time: with one of them in place the
Hub world (`hubworld.py`) must report a violation by itself (tests/drive/test_simulation.py). Each is a choice
the kit's Hub store rejects (issue 40):

  40.1-unfenced       commits made without `parent_commit`: nothing stops a runtime taken over from committing
  40.2-one-listing    one tree listing says what the run holds (a listing that misses a file is believed)
  40.3-unread-absent  a file the Hub did not answer for (the client's LocalEntryNotFoundError) counts as absent
"""

from __future__ import annotations

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


HUB_RULES = {"40.1-unfenced": unfenced_commits, "40.2-one-listing": one_listing, "40.3-unread-absent": unread_is_absent}
