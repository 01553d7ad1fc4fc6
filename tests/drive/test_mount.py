"""Where the run folder lives, and mounting Drive with a stand-in google.colab."""

import errno
from pathlib import Path

import pytest

from colab_kit.drive import mount as drive_mod
from colab_kit.errors import DriveError


def test_root_precedence(monkeypatch, tmp_path, fake_colab):
    monkeypatch.setenv("COLAB_KIT_DRIVE", str(tmp_path / "env"))
    assert drive_mod.resolve_root(tmp_path / "arg") == (tmp_path / "arg", False)
    assert drive_mod.resolve_root() == (tmp_path / "env", False)
    assert fake_colab.calls == []  # an explicit root never mounts Drive


def test_default_outside_colab_is_local_drive_folder(monkeypatch, tmp_path):
    monkeypatch.delenv("COLAB_KIT_DRIVE", raising=False)
    monkeypatch.delenv("COLAB_RELEASE_TAG", raising=False)
    monkeypatch.chdir(tmp_path)
    assert drive_mod.resolve_root() == (tmp_path / "drive", False)


def test_in_colab_mounts_and_uses_mydrive_colab_kit(monkeypatch, tmp_path, fake_colab):
    monkeypatch.delenv("COLAB_KIT_DRIVE", raising=False)
    mount = tmp_path / "content" / "drive"
    monkeypatch.setattr(drive_mod, "COLAB_MOUNT", str(mount))
    root, on_drive = drive_mod.resolve_root()
    assert on_drive and root == mount / "MyDrive" / "colab_kit"
    assert fake_colab.calls == [(str(mount), False)]
    drive_mod.resolve_root()  # mounted already: a no-op
    assert len(fake_colab.calls) == 1


def test_mount_point_with_files_fails_with_advice(tmp_path, fake_colab):
    mount = tmp_path / "drive"
    mount.mkdir()
    (mount / "oops.txt").write_text("written before mounting")
    with pytest.raises(DriveError, match="already holds files.*move those files away"):
        drive_mod.mount_drive(str(mount))
    assert fake_colab.calls == []


def test_errno_107_on_mount_retries_with_force_remount(tmp_path, fake_colab):
    mount = tmp_path / "drive"
    attempts = []

    def flaky_mount(mountpoint, force_remount=False, **kwargs):
        attempts.append(force_remount)
        if not force_remount:
            raise OSError(errno.ENOTCONN, "Transport endpoint is not connected")
        Path(mountpoint, "MyDrive").mkdir(parents=True)

    fake_colab.drive.mount = flaky_mount
    assert drive_mod.mount_drive(str(mount)) == mount / "MyDrive"
    assert attempts == [False, True]


def test_mount_failure_is_a_drive_error_with_a_way_out(tmp_path, fake_colab):
    def failing(mountpoint, force_remount=False, **kwargs):
        raise ValueError("mount failed")

    fake_colab.drive.mount = failing
    with pytest.raises(DriveError, match="mounting Google Drive .* failed.*drive="):
        drive_mod.mount_drive(str(tmp_path / "drive"))
