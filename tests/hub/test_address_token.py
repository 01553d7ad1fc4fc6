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


def test_the_token_is_the_clients_own_and_kaggles_secret_before_a_saved_login(no_tokens, monkeypatch, fake_colab,
                                                                             tmp_path):
    """huggingface_hub.get_token() decides, as for every Hugging Face library in the notebook ($HF_TOKEN, a saved
    login and Colab's secret, in the client's order); the kit adds Kaggle's secrets, before a saved login."""
    from huggingface_hub import get_token
    from huggingface_hub.utils import _auth

    userdata = types.ModuleType("google.colab.userdata")
    secrets = {}

    class SecretNotFoundError(Exception):
        pass

    class NotebookAccessError(Exception):
        pass

    def get(name):
        if name not in secrets:
            raise SecretNotFoundError(name)
        return secrets[name]

    userdata.get, userdata.SecretNotFoundError, userdata.NotebookAccessError = get, SecretNotFoundError, NotebookAccessError
    monkeypatch.setitem(sys.modules, "google.colab.userdata", userdata)
    fake_colab.userdata = userdata
    monkeypatch.setattr(_auth, "is_google_colab", lambda: True)  # the client's own Colab check

    def colab_asked_anew():  # the client asks Colab once a session: each look here is a new session
        monkeypatch.setattr(_auth, "_IS_GOOGLE_COLAB_CHECKED", False, raising=False)

    kaggle = types.ModuleType("kaggle_secrets")

    class UserSecretsClient:
        def get_secret(self, name):
            return {"HF_TOKEN": "hf_kaggle"}[name]

    kaggle.UserSecretsClient = UserSecretsClient
    monkeypatch.setitem(sys.modules, "kaggle_secrets", kaggle)

    errors = types.ModuleType("google.colab.errors")
    errors.Error = type("Error", (Exception,), {})
    monkeypatch.setitem(sys.modules, "google.colab.errors", errors)

    colab_asked_anew()
    with pytest.raises(ColabKitError, match="key icon on the left -> add a secret named HF_TOKEN"):
        find_token()
    secrets["HF_TOKEN"] = "hf_colab"
    colab_asked_anew()
    assert find_token() == ("hf_colab", "Colab secrets")
    monkeypatch.setenv("HF_TOKEN", "hf_env")  # both: the client's order decides (2.x: $HF_TOKEN; 0.x: Colab's)
    colab_asked_anew()
    chosen = get_token()
    colab_asked_anew()
    assert find_token() == (chosen, {"hf_env": "$HF_TOKEN", "hf_colab": "Colab secrets"}[chosen])
    monkeypatch.delenv("HF_TOKEN")
    del secrets["HF_TOKEN"]
    saved = tmp_path / "hf" / "token"
    saved.parent.mkdir(parents=True, exist_ok=True)
    saved.write_text("hf_saved")
    colab_asked_anew()
    assert find_token() == ("hf_saved", "a saved login")
    monkeypatch.setenv("KAGGLE_KERNEL_RUN_TYPE", "Interactive")
    colab_asked_anew()
    assert find_token() == ("hf_kaggle", "Kaggle secrets")  # the notebook's own secret before the machine's login
    assert find_token("hf_given") == ("hf_given", "given")


def test_the_token_is_never_looked_for_from_a_thread(no_tokens, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_env")
    caught = []
    worker = threading.Thread(target=lambda: caught.append(pytest.raises(ColabKitError, find_token)))
    worker.start()
    worker.join()
    assert "main thread only" in str(caught[0].value)


def test_a_hub_store_with_a_client_older_than_it_speaks_is_refused_saying_what_to_install(monkeypatch, tmp_path):
    """transformers 4.57 pins huggingface_hub below 1.0, whose errors and answers the Hub store does not speak
    (its tests fail there): refused at the start, before anything is asked of the Hub."""
    import huggingface_hub

    import colab_kit as ck

    monkeypatch.setenv("HF_TOKEN", "hf_test")
    monkeypatch.setattr(huggingface_hub, "__version__", "0.36.2")
    with pytest.raises(ColabKitError, match=r"needs huggingface_hub 1.0 or newer, and this runtime has 0.36.2.*"
                                            r"pip install -U 'transformers>=5' 'huggingface_hub>=1'"):
        ck.start_run("old", store="hf://user/runs", local_dir=tmp_path / "vm" / "old", quiet=True)


def test_a_429_is_waited_for_as_long_as_the_hub_says_by_retry_after_or_its_rate_limit_headers():
    """The Hub's 429s carry IETF rate-limit headers (read by the client's parse_ratelimit_headers); Retry-After may
    be absent. The kit waits for the later of the two (before: Retry-After alone, else its own short backoff)."""
    from colab_kit.hub.client import retry_after

    def refused(**headers):
        return types.SimpleNamespace(response=types.SimpleNamespace(status_code=429, headers=headers))

    spent = {"ratelimit": '"api";r=0;t=55', "ratelimit-policy": '"fixed window";"api";q=500;w=300'}
    assert retry_after(refused(**spent)) == 55.0
    assert retry_after(refused(**spent, **{"Retry-After": "70"})) == 70.0
    assert retry_after(refused(ratelimit='"api";r=12;t=55')) is None  # requests left: the kit's own backoff
    assert retry_after(refused(**{"Retry-After": "3"})) == 3.0
    assert retry_after(refused()) is None and retry_after(ValueError()) is None
