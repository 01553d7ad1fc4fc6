"""The Hub store's address (`store="hf://..."`) and the token, found on the main thread where users keep it."""

import sys
import threading
import types

import pytest

from colab_kit.errors import ColabKitError
from colab_kit.hub.address import HubAddress
from colab_kit.hub.token import find_token


@pytest.mark.parametrize("text, repo_id, repo_type, prefix", [
    ("hf://alice/runs", "alice/runs", "model", ""),
    ("hf://datasets/alice/runs", "alice/runs", "dataset", ""),
    ("hf://models/alice/runs/exp/2026", "alice/runs", "model", "exp/2026"),
    ("hf://alice/runs/", "alice/runs", "model", ""),
])
def test_addresses_name_the_repo_its_type_and_the_folder_of_runs(text, repo_id, repo_type, prefix):
    address = HubAddress.parse(text)
    assert (address.repo_id, address.repo_type, address.prefix) == (repo_id, repo_type, prefix)
    assert address.path("rna-bert", "lease.json") == "/".join(p for p in (prefix, "rna-bert", "lease.json") if p)
    assert HubAddress.parse(str(address)) == address  # said back the way it is written


@pytest.mark.parametrize("text, said", [
    ("alice/runs", "is written store='hf://<user>/<repo>'"),
    ("hf://alice", "name the owner and the repo"),
    ("hf://spaces/alice/app", "a Space cannot hold runs"),
    ("hf://alice/runs/../x", "'..' is not a valid repo or folder name"),
    ("hf://alice/r?s", "'r?s' is not a valid"),
])
def test_a_bad_address_says_how_it_is_written(text, said):
    with pytest.raises(ValueError, match=None) as caught:
        HubAddress.parse(text)
    assert said in str(caught.value)


@pytest.fixture
def no_tokens(monkeypatch, tmp_path):
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "KAGGLE_KERNEL_RUN_TYPE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # no token saved by a login
    monkeypatch.setenv("HF_TOKEN_PATH", str(tmp_path / "hf" / "token"))
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "hf" / "token"), raising=False)


def test_the_token_comes_from_the_environment_then_colab_then_kaggle_secrets(no_tokens, monkeypatch, fake_colab):
    userdata = types.ModuleType("google.colab.userdata")
    secrets = {}

    def get(name):
        if name not in secrets:
            raise KeyError(name)  # Colab raises SecretNotFoundError; any failure means "not there"
        return secrets[name]

    userdata.get = get
    monkeypatch.setitem(sys.modules, "google.colab.userdata", userdata)
    fake_colab.userdata = userdata
    kaggle = types.ModuleType("kaggle_secrets")

    class UserSecretsClient:
        def get_secret(self, name):
            return {"HF_TOKEN": "hf_kaggle"}[name]

    kaggle.UserSecretsClient = UserSecretsClient
    monkeypatch.setitem(sys.modules, "kaggle_secrets", kaggle)

    with pytest.raises(ColabKitError, match="key icon on the left -> add a secret named HF_TOKEN"):
        find_token()
    monkeypatch.setenv("KAGGLE_KERNEL_RUN_TYPE", "Interactive")
    assert find_token() == ("hf_kaggle", "Kaggle secrets")
    secrets["HF_TOKEN"] = "hf_colab"
    assert find_token() == ("hf_colab", "Colab secrets")
    monkeypatch.setenv("HF_TOKEN", "hf_env")
    assert find_token() == ("hf_env", "$HF_TOKEN")
    assert find_token("hf_given") == ("hf_given", "given")


def test_the_token_is_never_looked_for_from_a_thread(no_tokens, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_env")
    caught = []
    worker = threading.Thread(target=lambda: caught.append(pytest.raises(ColabKitError, find_token)))
    worker.start()
    worker.join()
    assert "main thread only" in str(caught[0].value)
