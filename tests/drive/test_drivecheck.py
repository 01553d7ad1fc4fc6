"""drive_check's waits go through the kit's clock seam (issue 46: waits in the kit through `clock`), so that a
check of a Drive that never commits can be judged on virtual time. Its measurements on a real mount are in
tests/drive/test_cloud_e2e.py and tests/drive/test_api_confirm.py."""

import time

from colab_kit.checkpoints.clock import Clock, use_clock
from colab_kit.drive import drivecheck
from colab_kit.drive.drivefs import ITEM_ID, MD5, UNCOMMITTED


class SteppedClock(Clock):
    """Time that moves only by the sleeps asked of it."""

    def __init__(self):
        self.t, self.sleeps = 0.0, []

    def monotonic(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.t += seconds


def test_watching_a_file_that_never_commits_waits_on_the_clock_seam(tmp_path, monkeypatch):
    never = {UNCOMMITTED: "1", ITEM_ID: "local-1", MD5: None}
    monkeypatch.setattr(drivecheck, "_read", lambda path: never)
    started = time.monotonic()
    with use_clock(SteppedClock()) as fake:
        timeline, seconds = drivecheck._watch(tmp_path / "f", lambda v: False, interval=1.0, timeout=900)
    assert seconds is None and timeline == [{"t": 0.0, **never}]  # one change seen: the first sample
    assert fake.t == 900 and set(fake.sleeps) == {1.0}  # 900 one-second looks, on the seam
    assert time.monotonic() - started < 10  # none of them on the real clock


def test_waiting_for_the_api_to_list_the_md5_waits_on_the_clock_seam(tmp_path):
    class Silent:
        calls = 0

        def children(self, folder):
            self.calls += 1
            raise OSError("the API did not answer")

    api = Silent()
    with use_clock(SteppedClock()) as fake:
        seconds = drivecheck._api_md5_s(api, tmp_path / "f", "0" * 32, interval=2.0, timeout=60, started=0.0)
    assert seconds is None and fake.t == 60 and api.calls == 30
