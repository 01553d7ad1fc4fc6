"""`start_run(confirm=...)`: checkpoints confirmed through Drive's API on the DriveFS emulator (issue 22).

The emulator runs without attributes (`--no-attrs`, a mount that reports nothing); the emulated Drive
API v3 serves its cloud and Trash folders to the real google-api-python-client.
"""

import json
import sys
import types
from pathlib import Path

import pytest
from drive_api_server import DriveApiServer
from drive_items import trash_index

import colab_kit as ck
from colab_kit.checkpoints.checkpoint import list_checkpoints
from colab_kit.checkpoints.journal import read_events
from colab_kit.checkpoints.validity import verify_folder
from colab_kit.drive import confirm as confirm_module
from colab_kit.drive.drivefs import API, UNCONFIRMED
from colab_kit.tasks.demo import tiny_trainer

pytestmark = pytest.mark.slow


@pytest.fixture
def api_drive(emulated_drive):
    """An emulated Drive without attributes at 20 MB/s, and the Drive API over its cloud."""
    drive = emulated_drive(rate=20e6, attrs=False)
    servers = []

    def serve(**kwargs):
        servers.append(DriveApiServer(drive.cloud, drive.trash, **kwargs).start())
        return servers[-1]

    yield drive, serve
    for server in servers:
        server.stop()


def train_with(run, steps=20):
    trainer = tiny_trainer(run, max_steps=steps, vocab_size=20000)  # ~4 MB checkpoints
    run.train(trainer)
    run.finish(timeout=120)
    return read_events(run.drive_dir / "events.jsonl")


def test_every_cloud_claim_comes_from_the_api_and_pruning_leaves_no_trash(api_drive, local):
    drive, serve = api_drive
    server = serve()
    run = ck.start_run("api", drive=drive.mountpoint / "colab_kit", local_dir=local, save_every=5, keep=1,
                       quiet=True, confirm=ck.DriveApi(server.url, drive.mountpoint))
    assert run.durability == API
    events = train_with(run)
    clouds = [e for e in events if e["event"] == "cloud" and "step" in e]
    assert clouds and all(e["via"] == "api" for e in clouds)
    assert max(e["step"] for e in clouds) == 20
    assert all(1 <= e["api_calls"] <= 10 for e in clouds), [e["api_calls"] for e in clouds]
    pruned = [s for e in events if e["event"] == "prune" for s in e["steps"]]
    assert pruned, "nothing was pruned: keep=1 with 4 checkpoints"
    cloud = {step: path for step, path in list_checkpoints(drive.cloud / "colab_kit" / "api" / "checkpoints")}
    assert 20 in cloud and verify_folder(cloud[20]) is None and not set(pruned) & set(cloud)
    # Deleted by id, for good: no file of a checkpoint in Drive's Trash (lease.json's old versions are)
    checkpoint_files = {p.name for p in cloud[20].iterdir()}
    trashed = [json.loads(line) for line in open(trash_index(str(drive.trash)))] if drive.trash_bytes() else []
    assert not [e for e in trashed if e["name"] in checkpoint_files], trashed
    assert run.status()["api_calls"] == sum(server.calls.values()) > 0
    assert {m for m, _, _ in server.log} >= {"GET", "DELETE"}


def test_rate_limits_and_server_errors_never_confirm_nor_delete_on_doubt(api_drive, local):
    drive, serve = api_drive
    server = serve(fail=0.3, seed=5)
    run = ck.start_run("faulty", drive=drive.mountpoint / "colab_kit", local_dir=local, save_every=5, keep=1,
                       quiet=True, confirm=ck.DriveApi(server.url, drive.mountpoint))
    events = train_with(run)
    assert {status for _, _, status in server.log} >= {403, 500}
    clouds = [e for e in events if e["event"] == "cloud" and "step" in e]
    print(f"API calls per confirmed checkpoint with 30 % of answers 403/500: {[e['api_calls'] for e in clouds]}")
    assert clouds and clouds[-1]["step"] == 20 and all(e["via"] == "api" for e in clouds)
    assert max(e["api_calls"] for e in clouds) <= 10
    for i, event in enumerate(events):  # a prune only ever follows a newer checkpoint's confirmation
        if event["event"] == "prune":
            assert any(e["event"] == "cloud" and e.get("step", -1) > max(event["steps"]) for e in events[:i])
    folder = drive.cloud / "colab_kit" / "faulty" / "checkpoints" / "checkpoint-20"
    assert verify_folder(folder) is None


def test_attributes_only_is_an_error_on_a_mount_without_them(api_drive, local):
    drive, _ = api_drive
    with pytest.raises(ck.DriveError, match="confirm='attributes', but .* does not report"):
        ck.start_run("attrs", drive=drive.mountpoint / "colab_kit", local_dir=local, quiet=True, confirm="attributes")
    run = ck.start_run("attrs", drive=drive.mountpoint / "colab_kit", local_dir=local, quiet=True)  # lease released
    run.finish()


def test_without_the_package_api_goes_on_as_auto_with_one_message(api_drive, local, monkeypatch, capsys):
    drive, serve = api_drive
    server = serve()
    monkeypatch.setitem(sys.modules, "googleapiclient", None)  # `import googleapiclient...` fails
    monkeypatch.setitem(sys.modules, "googleapiclient.discovery", None)
    run = ck.start_run("nopkg", drive=drive.mountpoint / "colab_kit", local_dir=local, quiet=True,
                       confirm=ck.DriveApi(server.url, drive.mountpoint))
    assert run.durability == UNCONFIRMED  # what "auto" gives on this mount
    said = capsys.readouterr()
    text = said.out + said.err
    assert text.count("confirm='api'") == 1 and "google-api-python-client is not installed" in text
    assert "going on as confirm='auto'" in text
    run.finish()


def test_a_refused_consent_in_colab_goes_on_as_auto(tmp_path, monkeypatch, capsys):
    auth = types.SimpleNamespace(authenticate_user=lambda: (_ for _ in ()).throw(RuntimeError("consent refused")))
    colab = types.ModuleType("google.colab")
    colab.auth = auth
    monkeypatch.setitem(sys.modules, "google.colab", colab)
    said = []
    run_dir = Path("/content/drive/MyDrive/colab_kit/run")
    kind, api = confirm_module.choose_confirmation("api", run_dir, UNCONFIRMED, colab=True, say=said.append)
    assert (kind, api) == (UNCONFIRMED, None)
    assert "asks Google for access to your Drive" in capsys.readouterr().out  # what it grants, and why
    assert len(said) == 1 and "not granted (RuntimeError: consent refused)" in said[0]
    # A folder outside Drive: nothing to ask consent for.
    kind, api = confirm_module.choose_confirmation("api", tmp_path, "plain", colab=True, say=said.append)
    assert (kind, api) == ("plain", None) and "is not in Google Drive" in said[-1]
    assert "asks Google" not in capsys.readouterr().out


def test_a_bad_confirm_is_refused_before_anything_starts(drive, local):
    with pytest.raises(ValueError, match="confirm='cloud'.*'auto'.*'attributes'.*'api'"):
        ck.start_run("bad", drive=drive, local_dir=local, confirm="cloud")
    assert not (drive / "bad").exists()


def test_drive_check_says_whether_the_api_confirms_and_how_soon(api_drive, monkeypatch):
    drive, serve = api_drive
    server = serve()
    report = ck.drive_check(drive.mountpoint, size_mb=4, interval=0.25, quiet=True,
                            api=ck.DriveApi(server.url, drive.mountpoint))
    assert report["attributes"] == {"user.drive.uncommitted": False, "user.drive.id": False, "user.drive.md5": False}
    api = report["api"]
    assert api["available"] and api["calls"] >= 1
    assert 4e6 / 20e6 * 0.8 <= api["md5_s"] <= 10, api  # the upload at 20 MB/s, seen through the API
    monkeypatch.delenv("COLAB_KIT_DRIVE_API", raising=False)
    report = ck.drive_check(drive.mountpoint, size_mb=1, interval=0.25, quiet=True)
    assert report["api"] == {"available": False, "why": "no Drive API given (COLAB_KIT_DRIVE_API, or api=ck.DriveApi(...))"}


def test_finding_5_a_fresh_start_never_deletes_the_archive_through_remembered_ids(api_drive, local):
    # Issue 27, finding 5: after resume=False, the API's remembered ids of checkpoints/checkpoint-N were the
    # archived folders', and the new run's pruning deleted archive/.../checkpoint-10 for good (no Trash).
    drive, serve = api_drive
    server = serve()
    api = ck.DriveApi(server.url, drive.mountpoint)  # one API object, its ids remembered across both runs
    first = ck.start_run("arch", drive=drive.mountpoint / "colab_kit", local_dir=local / "a", save_every=5, keep=1,
                         quiet=True, confirm=api)
    train_with(first, steps=10)
    fresh = ck.start_run("arch", drive=drive.mountpoint / "colab_kit", local_dir=local / "b", save_every=5, keep=1,
                         quiet=True, confirm=api, resume=False)
    events = train_with(fresh, steps=15)
    run_dir = drive.cloud / "colab_kit" / "arch"
    archived = [p for p in (run_dir / "archive").iterdir()]
    assert len(archived) == 1
    assert verify_folder(archived[0] / "checkpoint-10") is None  # the archive is whole in the cloud
    fresh_events = events[[i for i, e in enumerate(events) if e["event"] == "archive"][-1]:]
    clouds = {e["step"] for e in fresh_events if e["event"] == "cloud" and "step" in e}
    assert 15 in clouds  # and the new run's checkpoints are confirmed (before: under the archive's folder id)
    assert [s for s, _ in list_checkpoints(run_dir / "checkpoints")] == [15]


def test_a_permission_refused_is_said_so_and_the_mount_decides(api_drive, local, capsys):
    """Issue 46, path 11: a 403 for a permission was taken for silence (the run kept asking, "did not answer",
    and nothing was ever confirmed or pruned). It is said as what it is, and the mount decides, as for refused
    credentials."""
    drive, serve = api_drive
    server = serve(refuse="insufficientPermissions")
    run = ck.start_run("refused", drive=drive.mountpoint / "colab_kit", local_dir=local, quiet=True,
                       confirm=ck.DriveApi(server.url, drive.mountpoint))
    try:
        assert run.durability == UNCONFIRMED  # what "auto" gives on this mount (no attributes)
        said = capsys.readouterr()
        text = said.out + said.err
        assert "refused (403: " in text and "a permission, not a rate limit" in text and "going on as" in text
        assert "did not answer" not in text
    finally:
        run.finish()


def test_finding_7_a_403_at_the_start_keeps_api_confirmation(api_drive, local):
    drive, serve = api_drive
    server = serve(fail_first=3)  # Drive's API answers its first three requests with 403 (a rate limit)
    run = ck.start_run("limited", drive=drive.mountpoint / "colab_kit", local_dir=local, save_every=5, keep=1,
                       quiet=True, confirm=ck.DriveApi(server.url, drive.mountpoint))
    assert run.durability == API  # before: "auto" for the whole run, here unconfirmed
    events = train_with(run, steps=10)
    assert any(e["event"] == "cloud" and e.get("via") == "api" for e in events)
