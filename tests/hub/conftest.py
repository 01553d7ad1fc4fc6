"""The kit's client of the emulated Hugging Face Hub (the `hub` fixture, tests/conftest.py)."""

import pytest

from colab_kit.hub.address import HubAddress
from colab_kit.hub.repo import HubRepo

TOKEN = "hf_test"


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
