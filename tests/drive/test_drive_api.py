"""`DriveApi` with the real google-api-python-client against the emulated Drive API v3 (issue 22).

The server (tests/scripts/drive_api_server.py) serves a cloud folder laid out as the DriveFS
emulator's, with its Trash index; nothing of the kit or of the client library is replaced.
"""

import hashlib
import json

import pytest
from drive_api_server import DriveApiServer
from drive_items import cloud_id, trash_index

from colab_kit.drive.driveapi import AmbiguousFolder, ApiRefused, ApiUnavailable, DriveApi, quote


def write(path, data: bytes):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def expected_of(folder) -> dict:
    return {p.name: (p.stat().st_size, hashlib.md5(p.read_bytes()).hexdigest()) for p in folder.iterdir()}


@pytest.fixture
def cloud(tmp_path):
    """A cloud folder with one checkpoint of a run, and a server over it; the local view is the cloud
    folder itself (no attributes: ids are found by name)."""
    root = tmp_path / "cloud"
    folder = root / "colab_kit" / "run" / "checkpoints" / "checkpoint-5"
    write(folder / "model.safetensors", b"w" * 3000)
    write(folder / "MANIFEST.json", b'{"step": 5}')
    server = DriveApiServer(root, tmp_path / "trash").start()
    yield root, folder, server
    server.stop()


def test_a_folder_is_confirmed_only_with_every_file_at_its_size_and_md5(cloud):
    root, folder, server = cloud
    api = DriveApi(server.url, root)
    expected = expected_of(folder)
    assert api.confirm(folder, expected) == (True, 0)
    assert ("GET", "/drive/v3/files", 200) in server.log  # the real client, over HTTP

    before = api.calls
    assert api.confirm(folder, expected) == (True, 0)
    assert api.calls - before == 1  # ids cached: one listing per check

    write(folder / "model.safetensors", b"x" * 3000)  # rewritten after upload: same size, other md5
    assert api.confirm(folder, expected) == (False, 3000)
    (folder / "MANIFEST.json").unlink()
    assert api.confirm(folder, expected) == (False, 11 + 3000)


def test_a_duplicate_named_folder_is_refused_and_a_trashed_one_ignored(cloud, tmp_path):
    root, folder, server = cloud
    run = root / "colab_kit" / "run"
    server.add_item(cloud_id(str(root), str(run.parent)), "run", folder=True, trashed=True)
    api = DriveApi(server.url, root)
    assert api.confirm(folder, expected_of(folder)) == (True, 0)  # the trashed twin is not looked at

    server.add_item(cloud_id(str(root), str(run.parent)), "run", folder=True)
    fresh = DriveApi(server.url, root)
    with pytest.raises(AmbiguousFolder, match="2 folders named 'run' in .*colab_kit.*Rename or delete the extra"):
        fresh.confirm(folder, expected_of(folder))


def test_a_trashed_copy_of_a_file_never_counts(cloud, tmp_path):
    root, folder, server = cloud
    expected = expected_of(folder)
    trashed = write(tmp_path / "trash" / "abc-model.safetensors", b"w" * 3000)
    with open(trash_index(str(tmp_path / "trash")), "a") as index:  # as the emulator notes a trashed file
        index.write(json.dumps({"id": "cloud-trashed", "parent": cloud_id(str(root), str(folder)),
                                "name": "model.safetensors", "file": trashed.name}) + "\n")
    (folder / "model.safetensors").unlink()
    api = DriveApi(server.url, root)
    assert api.confirm(folder, expected) == (False, 3000)
    everything = api._execute(api.service().files().list(q=f"'{api.folder_id(folder)}' in parents",
                                                         fields="files(name, trashed)"))
    assert {"name": "model.safetensors", "trashed": True} in everything["files"]  # Drive lists it without the filter


def test_names_are_quoted_for_drives_query_language(tmp_path):
    root = tmp_path / "cloud"
    odd = root / "it's a \\ run" / "checkpoints" / "checkpoint-1"
    write(odd / "a.bin", b"a")
    server = DriveApiServer(root, tmp_path / "trash").start()
    try:
        assert quote("it's a \\ run") == "'it\\'s a \\\\ run'"
        assert DriveApi(server.url, root).confirm(odd, expected_of(odd)) == (True, 0)
    finally:
        server.stop()


def test_listings_follow_every_page(tmp_path):
    root = tmp_path / "cloud"
    folder = root / "run" / "checkpoints" / "checkpoint-9"
    for i in range(25):
        write(folder / f"shard-{i:02d}.bin", bytes([i]) * 10)
    server = DriveApiServer(root, tmp_path / "trash", max_page=10).start()
    try:
        api = DriveApi(server.url, root)
        assert api.confirm(folder, expected_of(folder)) == (True, 0)
        assert len(api.children(folder)) == 25
    finally:
        server.stop()


def test_a_permission_403_is_a_refusal_never_an_answer_and_never_a_rate_limit(cloud):
    """Issue 46, path 11: every 403 was "did not answer, ask again", a permission refused included. The
    client's own rule (it retries a 403 only for rateLimitExceeded and userRateLimitExceeded) tells them
    apart: a refusal is still unknown for the files, and says that asking again will not help."""
    root, folder, _ = cloud
    server = DriveApiServer(root, root.parent / "trash", refuse="insufficientPermissions").start()
    try:
        with pytest.raises(ApiRefused, match=r"refused \(403: .*insufficientPermissions.*a permission, not a rate"):
            DriveApi(server.url, root).confirm(folder, expected_of(folder))
    finally:
        server.stop()


def test_rate_limits_and_server_errors_are_never_an_answer(cloud):
    root, folder, _ = cloud
    expected = expected_of(folder)
    write(folder / "model.safetensors", b"y" * 3000)  # not what the manifest says
    server = DriveApiServer(root, root.parent / "trash", fail=0.3, seed=4).start()
    try:
        api = DriveApi(server.url, root)
        answers, unknown = [], 0
        for _ in range(60):
            try:
                answers.append(api.confirm(folder, expected))
            except ApiUnavailable as exc:
                assert "403" in str(exc) or "500" in str(exc)
                assert not isinstance(exc, ApiRefused)  # a rate limit: asking again is the answer
                unknown += 1
        assert unknown >= 10 and answers and all(a == (False, 3000) for a in answers)
        assert {status for _, _, status in server.log} == {200, 403, 500}
        assert api.calls == sum(server.calls.values())  # every request counted
    finally:
        server.stop()


def test_delete_is_permanent_and_by_id(cloud):
    root, folder, server = cloud
    api = DriveApi(server.url, root)
    item = cloud_id(str(root), str(folder))
    api.delete(folder)
    assert ("DELETE", f"/drive/v3/files/{item}", 204) in server.log  # one call, the folder's id
    assert not folder.exists() and (folder.parent).is_dir()
    assert not (root.parent / "trash").exists() or not any((root.parent / "trash").iterdir())  # no Trash
    with pytest.raises(FileNotFoundError):
        api.confirm(folder, {"MANIFEST.json": (11, None)})


def test_the_endpoint_comes_from_the_environment(tmp_path):
    assert DriveApi.from_environment({}) is None
    api = DriveApi.from_environment({"COLAB_KIT_DRIVE_API": "http://127.0.0.1:9", "COLAB_KIT_DRIVE_ROOT": str(tmp_path)})
    assert api.endpoint == "http://127.0.0.1:9" and api.root == tmp_path
    with pytest.raises(ValueError, match="give the API's address"):
        DriveApi("127.0.0.1:9")
    with pytest.raises(ApiUnavailable, match="unreachable"):  # nothing listens there
        api.confirm(tmp_path / "run", {})
