"""The emulated Hugging Face Hub (tests/scripts/hub_server.py) and the kit's client of it."""

import time
import types

import pytest
from huggingface_hub import constants, file_download
from huggingface_hub.utils import _http
from hub_server import HubServer

from colab_kit.hub.address import HubAddress
from colab_kit.hub.repo import HubRepo

TOKEN = "hf_test"


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """A running emulated Hub. The client must not upload through Xet (with hf_xet installed it does so on its
    own after preupload), which the emulated Hub does not speak; downloads stay plain HTTP either way."""
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_TELEMETRY", True)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf_home" / "hub"))
    # The client's own backoff (1, 2, 4, 8, 8 s between its tries) at a hundredth: the kit's retries are the
    # ones under test, and they wait on the kit's clock.
    quick = types.SimpleNamespace(**{name: getattr(time, name) for name in ("time", "monotonic", "perf_counter")},
                                  sleep=lambda seconds: time.sleep(seconds / 100))
    monkeypatch.setattr(_http, "time", quick)
    monkeypatch.setattr(file_download, "time", quick)
    with HubServer() as server:
        yield server


@pytest.fixture
def make_repo(hub):
    """`make_repo("hf://user/runs", **kwargs)`: a `HubRepo` on the emulated Hub, quick to give up in tests."""

    def make(address: str = "hf://user/runs", **kwargs) -> HubRepo:
        kwargs.setdefault("waits", (0.05, 0.1, 0.2))
        kwargs.setdefault("commit_wait", (3.0, 1e7))
        repo = HubRepo(HubAddress.parse(address), TOKEN, endpoint=hub.url, **kwargs)
        repo.create()
        return repo

    return make
