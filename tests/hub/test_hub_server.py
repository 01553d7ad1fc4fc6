"""Tests of the emulated Hub, driven only through the real huggingface_hub client.

Client behaviour pinned here (huggingface_hub 2.4.0):
- retried with backoff (utils/_http.http_backoff; 408/429/500/502/503/504, 1 s then x2, Retry-After honoured
  as Retry-After + 1 s): preupload, LFS batch/PUT/verify, paginated listings (list_repo_tree,
  list_repo_commits), the HEAD of hf_hub_download (second round, only if no cached copy).
- NOT retried: the commit POST, repo_info/model_info, create_repo, get_paths_info, super_squash_history;
  the download GET retries 408/429 only (5xx raises), but resumes with a Range request after a
  timeout/disconnect mid-body (5 attempts, 1 s apart, reset whenever bytes arrive).
- the commit POST has NO timeout by default (the shared httpx2 client uses timeout=None).
"""

import hashlib
import os
import tempfile
import time

import httpx2  # huggingface_hub 2.x ships on httpx2
import pytest
from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi, constants, file_download, hf_hub_download
from huggingface_hub.errors import (
    HfHubHTTPError,
    LocalEntryNotFoundError,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import _http
from hub_server import HubServer
from hub_state import git_blob_oid

# The client itself PUTs LFS files with `data=fileobj`, which httpx2 deprecates: not our concern here.
pytestmark = pytest.mark.filterwarnings("ignore:Use 'content=:DeprecationWarning")

REPO = "user/repo"
WEIGHTS = os.urandom(2 * 1024 * 1024)  # 2 MB, LFS by extension
CONFIG = b'{"hidden_size": 8}'


@pytest.fixture
def hub(monkeypatch, tmp_path):
    # With hf_xet installed the client uploads through Xet on its own, which the emulated Hub does not speak.
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_TELEMETRY", True)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    with HubServer() as server:
        yield server


@pytest.fixture
def api(hub):
    return HfApi(endpoint=hub.url, token="hf_test")


@pytest.fixture
def repo(api):
    api.create_repo(REPO)
    return REPO


def commit_model(api, **kwargs):
    ops = [CommitOperationAdd("model/weights.safetensors", WEIGHTS), CommitOperationAdd("model/config.json", CONFIG)]
    return api.create_commit(REPO, ops, commit_message="add model", **kwargs)


def download(hub, filename, **kwargs):
    kwargs.setdefault("cache_dir", tempfile.mkdtemp(prefix="hub_cache_"))
    path = hf_hub_download(REPO, filename, endpoint=hub.url, token="hf_test", **kwargs)
    with open(path, "rb") as f:
        return f.read(), os.path.basename(os.path.realpath(path))


@pytest.fixture
def client_timeout():
    """Give the shared client a read timeout (it has none by default) for the test's duration."""

    def set_timeout(seconds):
        def factory():
            client = _http.default_client_factory()
            client.timeout = httpx2.Timeout(seconds)
            return client

        _http.set_client_factory(factory)

    yield set_timeout
    _http.set_client_factory(_http.default_client_factory)


# -- repos, commits, listings, downloads --------------------------------------------------------
def test_create_repo_exist_ok_and_repo_info(api, hub):
    url = api.create_repo(REPO)
    assert url.repo_id == REPO and api.create_repo(REPO, exist_ok=True) == url
    with pytest.raises(HfHubHTTPError) as exc:
        api.create_repo(REPO)
    assert exc.value.response.status_code == 409
    info = api.model_info(REPO)
    assert info.sha == hub.state.head(REPO) and [s.rfilename for s in info.siblings] == [".gitattributes"]


def test_commit_lfs_and_regular_then_tree_and_download(api, hub, repo):
    info = commit_model(api)
    assert info.oid == hub.state.head(REPO)
    assert hub.state.count("lfs_upload", "PUT") == 1  # only the LFS file goes through the batch API
    tree = {e.path: e for e in api.list_repo_tree(REPO, recursive=True)}
    assert set(tree) == {".gitattributes", "model", "model/weights.safetensors", "model/config.json"}
    weights, config = tree["model/weights.safetensors"], tree["model/config.json"]
    assert weights.lfs.sha256 == hashlib.sha256(WEIGHTS).hexdigest() and weights.size == len(WEIGHTS)
    assert config.lfs is None and config.blob_id == git_blob_oid(CONFIG)
    # The cached blob is named after X-Linked-Etag (sha256) for LFS, after ETag (git sha1) otherwise.
    assert download(hub, "model/weights.safetensors") == (WEIGHTS, weights.lfs.sha256)
    assert download(hub, "model/config.json") == (CONFIG, config.blob_id)


def test_upload_folder(api, hub, repo, tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "model.safetensors").write_bytes(WEIGHTS)
    (tmp_path / "ckpt" / "config.json").write_bytes(CONFIG)
    api.upload_folder(repo_id=REPO, folder_path=tmp_path, commit_message="folder")
    files = hub.state.files(REPO)
    assert files["ckpt/model.safetensors"] == WEIGHTS and files["ckpt/config.json"] == CONFIG


def test_unchanged_files_make_no_commit(api, hub, repo):
    first = commit_model(api)
    second = commit_model(api)  # preupload returns the remote oids: the client drops no-op files
    assert second.oid == first.oid and len(hub.state.commit_log(REPO)) == 2
    assert hub.state.count("commit", "POST") == 1


def test_parent_commit_mismatch_is_412_hfhubhttperror_and_commits_nothing(api, hub, repo):
    stale = hub.state.head(REPO)
    commit_model(api)
    head = hub.state.head(REPO)
    with pytest.raises(HfHubHTTPError) as exc:
        api.create_commit(REPO, [CommitOperationAdd("x.txt", b"x")], commit_message="late", parent_commit=stale)
    assert exc.value.response.status_code == 412 and type(exc.value) is HfHubHTTPError
    assert hub.state.head(REPO) == head and "x.txt" not in hub.state.files(REPO)
    ok = api.create_commit(REPO, [CommitOperationAdd("x.txt", b"x")], commit_message="ok", parent_commit=head)
    assert hub.state.head(REPO) == ok.oid


def test_delete_folder_and_missing_file(api, hub, repo):
    commit_model(api)
    api.create_commit(REPO, [CommitOperationDelete("model/")], commit_message="rm model")
    assert set(hub.state.files(REPO)) == {".gitattributes"}
    with pytest.raises(RemoteEntryNotFoundError):
        api.delete_file("nope.txt", REPO)


def test_list_repo_commits_newest_first(api, hub, repo):
    for i in range(3):
        api.create_commit(REPO, [CommitOperationAdd(f"f{i}.txt", b"%d" % i)], commit_message=f"c{i}")
    commits = api.list_repo_commits(REPO)
    assert [c.title for c in commits] == ["c2", "c1", "c0", "initial commit"]
    assert [c.commit_id for c in commits] == [c.id for c in hub.state.commit_log(REPO)]


def test_listings_follow_link_header_pagination(hub, repo, api):
    hub.page_size = 2
    for i in range(3):
        api.create_commit(REPO, [CommitOperationAdd(f"d/f{i}.txt", b"%d" % i)], commit_message=f"c{i}")
    assert len(list(api.list_repo_tree(REPO, recursive=True))) == 5  # .gitattributes, d, 3 files
    assert hub.state.count("tree") == 3
    assert len(api.list_repo_commits(REPO)) == 4 and hub.state.count("commits") == 2


def test_get_paths_info_and_expand(api, hub, repo):
    info = commit_model(api)
    got = api.get_paths_info(REPO, ["model", "model/config.json", "missing"], expand=True)
    assert [e.path for e in got] == ["model", "model/config.json"]
    assert got[1].last_commit.oid == info.oid


def test_super_squash_history(api, hub, repo):
    commit_model(api)
    files = hub.state.files(REPO)
    api.super_squash_history(REPO, commit_message="squashed")
    assert [c.title for c in api.list_repo_commits(REPO)] == ["squashed"]
    assert hub.state.files(REPO) == files


def test_not_found_errors(api, hub, repo):
    with pytest.raises(RepositoryNotFoundError):
        api.model_info("user/missing")
    with pytest.raises(RevisionNotFoundError):
        api.model_info(REPO, revision="0" * 40)
    with pytest.raises(RemoteEntryNotFoundError):
        download(hub, "missing.bin")


def test_require_token():
    with HubServer(require_token=True) as hub:
        HfApi(endpoint=hub.url, token="hf_test").create_repo(REPO)
        with pytest.raises(RepositoryNotFoundError):  # the client maps a 401 on repo APIs to "not found"
            HfApi(endpoint=hub.url, token=False).model_info(REPO)


def test_lfs_file_never_uploaded_is_rejected(api, hub, repo):
    op = CommitOperationAdd("ghost.safetensors", b"never uploaded")
    op._upload_mode, op._is_uploaded = "lfs", True  # a client that skipped the LFS upload
    with pytest.raises(HfHubHTTPError) as exc:
        api.create_commit(REPO, [op], commit_message="ghost")
    assert exc.value.response.status_code == 422 and len(hub.state.commit_log(REPO)) == 1


def test_uploads_go_to_xet_unless_disabled(api, hub, repo, monkeypatch):
    pytest.importorskip("hf_xet")
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", False)
    with pytest.raises(ConnectionError, match="xet-write-token"):
        api.create_commit(REPO, [CommitOperationAdd("w.safetensors", b"w")], commit_message="xet")
    assert hub.state.count("xet_token") == 1 and hub.state.count("lfs_batch") == 0


# -- status faults: who retries -----------------------------------------------------------------
@pytest.mark.parametrize("status", [500, 503])
def test_preupload_5xx_is_retried_by_http_backoff(api, hub, repo, status):
    hub.faults.fail_next(1, status, endpoint="preupload")
    commit_model(api)
    assert hub.state.count("preupload") == 2 and "model/config.json" in hub.state.files(REPO)


def test_lfs_batch_429_retry_after_is_honoured(api, hub, repo):
    hub.faults.fail_next(1, 429, endpoint="lfs_batch", retry_after=0)
    start = time.monotonic()
    commit_model(api)
    assert hub.state.count("lfs_batch") == 2 and time.monotonic() - start >= 1  # Retry-After + 1 s


@pytest.mark.parametrize("status", [429, 500, 502, 503])
def test_commit_post_is_not_retried(api, hub, repo, status):
    head = hub.state.head(REPO)
    hub.faults.fail_next(1, status, endpoint="commit")
    with pytest.raises(HfHubHTTPError) as exc:
        commit_model(api)
    assert exc.value.response.status_code == status
    assert hub.state.count("commit") == 1 and hub.state.head(REPO) == head


def test_repo_info_is_not_retried(api, hub, repo):
    hub.faults.fail_next(1, 503, endpoint="repo_info")
    with pytest.raises(HfHubHTTPError):
        api.model_info(REPO)


def test_list_repo_tree_is_retried(api, hub, repo):
    hub.faults.fail_next(1, 502, endpoint="tree")
    assert [e.path for e in api.list_repo_tree(REPO)] == [".gitattributes"]
    assert hub.state.count("tree") == 2


def test_download_head_5xx_is_retried(api, hub, repo):
    commit_model(api)
    hub.faults.fail_next(1, 500, method="HEAD", endpoint="resolve")
    assert download(hub, "model/config.json")[0] == CONFIG
    assert hub.state.count("resolve", "HEAD") == 2


def test_download_head_5xx_persisting_raises_local_entry_not_found(api, hub, repo, monkeypatch):
    monkeypatch.setattr(_http.time, "sleep", lambda s: None)  # skip backoff waits (1+2+4+8+8 s)
    commit_model(api)
    hub.faults.fail_next(100, 503, method="HEAD", endpoint="resolve")
    with pytest.raises(LocalEntryNotFoundError) as exc:
        download(hub, "model/config.json")
    assert exc.value.__cause__.response.status_code == 503
    assert hub.state.count("resolve", "HEAD") == 7  # 1 + (1 + 5 retries)


def test_download_get_5xx_is_not_retried_but_429_is(api, hub, repo):
    commit_model(api)
    hub.faults.fail_next(1, 500, method="GET", endpoint="resolve")
    with pytest.raises(HfHubHTTPError):
        download(hub, "model/config.json")
    hub.faults.fail_next(1, 429, method="GET", endpoint="resolve", retry_after=0)
    assert download(hub, "model/config.json")[0] == CONFIG


# -- stalls, lost answers, incomplete listings --------------------------------------------------
@pytest.mark.parametrize("chunk_size, resumed_range", [
    (64 * 1024, f"bytes={len(WEIGHTS) // 2}-"),  # the received half was written => Range resume
    (None, None),  # default 10 MiB chunks: the half never reached disk => full restart, no Range
])
def test_stalled_download_times_out_then_resumes(api, hub, repo, monkeypatch, chunk_size, resumed_range):
    commit_model(api)
    monkeypatch.setattr(constants, "HF_HUB_DOWNLOAD_TIMEOUT", 0.5)
    if chunk_size:
        monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", chunk_size)
    hub.faults.stall(3, method="GET", endpoint="resolve", body_fraction=0.5)
    assert download(hub, "model/weights.safetensors")[0] == WEIGHTS
    gets = [r for r in hub.state.requests if r["endpoint"] == "resolve" and r["method"] == "GET"]
    assert [r["range"] for r in gets] == [None, resumed_range]


def test_download_stalled_for_good_raises_read_timeout(api, hub, repo, monkeypatch):
    commit_model(api)
    monkeypatch.setattr(constants, "HF_HUB_DOWNLOAD_TIMEOUT", 0.3)
    monkeypatch.setattr(file_download.time, "sleep", lambda s: None)  # skip the 1 s between resumes
    hub.faults.stall(30, n=100, method="GET", endpoint="resolve", body_fraction=0)
    with pytest.raises(httpx2.ReadTimeout):
        download(hub, "model/weights.safetensors")
    assert hub.state.count("resolve", "GET") == 6  # first try + 5 resumes


def test_stalled_metadata_head_is_retried_with_longer_timeout(api, hub, repo):
    commit_model(api)
    hub.faults.stall(3, method="HEAD", endpoint="resolve")
    assert download(hub, "model/config.json", etag_timeout=0.3)[0] == CONFIG
    assert hub.state.count("resolve", "HEAD") == 2


def test_commit_applied_but_connection_dropped(api, hub, repo):
    head = hub.state.head(REPO)
    hub.faults.commit_completes_after_client_gives_up(drop=True)
    with pytest.raises(httpx2.RemoteProtocolError):
        commit_model(api)
    assert hub.state.head(REPO) != head and "model/config.json" in hub.state.files(REPO)
    assert hub.state.count("commit") == 1  # not retried: a retry would have made a second commit


def test_commit_applied_after_client_timeout(api, hub, repo, client_timeout):
    client_timeout(0.5)
    head = hub.state.head(REPO)
    hub.faults.commit_completes_after_client_gives_up(seconds=3)
    with pytest.raises(httpx2.ReadTimeout):
        commit_model(api)
    assert hub.state.head(REPO) != head and hub.state.commit_log(REPO)[0].title == "add model"


def test_listing_hides_files_once(api, hub, repo):
    commit_model(api)
    hub.faults.hide_in_listing(r"\.safetensors$", n=1)
    first = {e.path for e in api.list_repo_tree(REPO, recursive=True)}
    second = {e.path for e in api.list_repo_tree(REPO, recursive=True)}
    assert "model/weights.safetensors" not in first and "model/weights.safetensors" in second
