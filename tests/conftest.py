"""Shared fixtures. Hardware and Colab are faked at one seam each:

- Drive trouble: `colab_kit.checkpoints.storage` functions (`DriveFaults`),
- Colab: a stand-in `google.colab` package in `sys.modules` (`fake_colab`),
- NVML and cgroups: a fake `pynvml` module and fake /proc, /sys files (in the tests),
- Google Drive's upload semantics: a real FUSE filesystem, the DriveFS emulator
  (`scripts/drivefs_emulator.py`, `emulated_drive`).
"""

from __future__ import annotations

import errno
import importlib.machinery
import os
import sys
import threading
import types
from pathlib import Path

import pytest

# Before torch is imported anywhere (here, in pytest's workers, and in every process they start): the
# tests train tiny models, which gain nothing from intra-op threads, and several test processes run at
# once (pytest-xdist, jobs, kernels, ranks), where one process's spinning OpenMP threads take the core
# another one needs.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from colab_kit.checkpoints import storage  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from emulated_drive import REQUIRE_ENV, EmulatedDrive, why_no_fuse  # noqa: E402


def _no_fuse(reason: str):
    if os.environ.get(REQUIRE_ENV):  # CI installs fuse3: there these tests must run
        pytest.fail(f"{REQUIRE_ENV} is set, but the DriveFS emulator cannot run: {reason}")
    pytest.skip(f"the DriveFS emulator needs FUSE: {reason}")


# No test may hang the suite (pytest-timeout, `timeout` in pyproject.toml, 300 s for any test): a test marked
# `slow(seconds)` gets TIMEOUT_FACTOR times its measured length on 2 cores, at least that. The factor covers
# a machine half as fast as the one measured, with the other workers' load on top.
TIMEOUT_FACTOR = 4


def _measured_s(item) -> float:
    slow = item.get_closest_marker("slow")
    return float(slow.args[0]) if slow is not None and slow.args else 0.0


def pytest_collection_modifyitems(config, items):
    """The long tests (marked slow: subprocesses, notebooks, emulated Drives) first, the longest of them
    (`slow(seconds)`, measured on 2 cores) before the others: with several workers the short ones then fill
    the gaps at the end, instead of one long test running alone. Each long test's time limit follows its
    measured length."""
    default = float(config.getini("timeout") or 0)
    for item in items:
        limit = TIMEOUT_FACTOR * _measured_s(item)
        if default and limit > default and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(limit))
    items.sort(key=lambda item: (item.get_closest_marker("slow") is None, -_measured_s(item)))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A test stopped by pytest-timeout says why it was stopped, beside the stacks the plugin prints."""
    report = yield
    if report.failed and call.excinfo is not None and "Timeout (>" in str(call.excinfo.value):
        limit = _measured_s(item)
        report.sections.append(("why it was stopped", (
            f"{item.nodeid} ran past its time limit and was stopped so that it cannot hang the suite: "
            + (f"it is marked slow({limit:g}) (its length measured on 2 cores), and its limit is "
               f"{TIMEOUT_FACTOR} times that" if limit else "the limit is pyproject.toml's `timeout`")
            + ". The stacks above show where it waited: a hang, or a test grown longer than its mark says "
              "(then measure it again and mend the mark).")))
    return report


@pytest.fixture(autouse=True)
def quick_looks(monkeypatch):
    """Looks spaced in time (absence is not evidence), a tenth as long in tests that run the kit in this
    process: the faults they inject last one read, or less than these waits. The simulator
    (tests/sim/, test_simulation.py) puts the kit's own spacing back: there files hide for seconds."""
    from colab_kit.checkpoints import looks, search

    monkeypatch.setattr(search, "RETRY_WAITS", tuple(w / 10 for w in search.RETRY_WAITS))
    monkeypatch.setattr(looks, "WAITS", tuple(w / 10 for w in looks.WAITS))


@pytest.fixture
def emulated_drive(tmp_path):
    """Makes DriveFS emulators: `emulated_drive(rate=4e6, quota=None, attrs=True)` returns a mounted
    `EmulatedDrive`; all are unmounted afterwards. Skipped, with the reason, where FUSE cannot mount."""
    reason = why_no_fuse()
    if reason:
        _no_fuse(reason)
    made = []

    def make(**kwargs) -> EmulatedDrive:
        drive = EmulatedDrive(tmp_path / f"gdrive{len(made)}", **kwargs)
        made.append(drive)
        try:
            return drive.mount()
        except RuntimeError as exc:
            _no_fuse(str(exc))

    yield make
    for drive in made:
        drive.unmount()


@pytest.fixture(scope="session")
def shared_tmp(tmp_path_factory) -> Path:
    """A folder of this test session that every pytest-xdist worker sees (each worker has its own basetemp
    below it): for what one worker computes once and the others read."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture
def drive(tmp_path) -> Path:
    """A temp folder standing in for MyDrive/colab_kit."""
    path = tmp_path / "drive"
    path.mkdir()
    return path


@pytest.fixture
def local(tmp_path) -> Path:
    """A temp folder standing in for /content (the VM's local disk)."""
    path = tmp_path / "local"
    path.mkdir()
    return path


class DriveFaults:
    """Makes persistent-folder operations under `root` fail while active.

    Patches the functions of `colab_kit.checkpoints.storage` (the kit's only path to the persistent
    folder, reads included), so the failure looks like a Drive mount that went away, or, with `ops`,
    `match` and `times`, like one named operation that fails now and then.
    """

    WRITES = ("copy_file", "atomic_write_bytes", "append_line", "make_dirs", "remove_tree")
    READS = ("read_bytes", "stat", "list_dir", "getxattr", "sha256_file", "file_digests")

    def __init__(self, monkeypatch, root: Path):
        self.root = Path(root)
        self.errno: int | None = None
        self.ops: set[str] = set(self.WRITES)
        self.match: str | None = None
        self.times: int | None = None
        self.calls = 0
        for name in self.WRITES + self.READS:
            original = getattr(storage, name)
            monkeypatch.setattr(storage, name, self._wrap(name, original))

    def _wrap(self, name, original):
        def wrapper(*args, **kwargs):
            paths = [Path(a) for a in args if isinstance(a, (str, os.PathLike))]
            hit = [p for p in paths if (self.root == p or self.root in p.parents)
                   and (self.match is None or self.match in str(p))]
            if self.errno is not None and hit and name in self.ops and self.times != 0:
                self.calls += 1
                if self.times is not None:
                    self.times -= 1
                raise OSError(self.errno, os.strerror(self.errno), str(hit[0]))
            return original(*args, **kwargs)

        return wrapper

    def fail(self, code: int = errno.ENOSPC, *, ops=None, match: str | None = None, times: int | None = None) -> None:
        """Fail with `code` from now on: the writes (or the operations named in `ops`: "reads" for every
        read) on paths containing `match`, `times` times (None: until `heal`)."""
        if ops == "reads":
            ops = self.READS
        self.errno, self.ops, self.match, self.times = code, set(ops or self.WRITES), match, times

    def heal(self) -> None:
        self.errno = None


@pytest.fixture
def drive_faults(monkeypatch, drive):
    return DriveFaults(monkeypatch, drive)


@pytest.fixture
def fake_colab(monkeypatch, tmp_path):
    """A stand-in `google.colab` whose `drive.mount` records calls and creates MyDrive."""
    calls = []
    google = types.ModuleType("google")
    colab = types.ModuleType("google.colab")
    drive_mod = types.ModuleType("google.colab.drive")

    def mount(mountpoint, force_remount=False, **kwargs):
        calls.append((mountpoint, force_remount))
        Path(mountpoint, "MyDrive").mkdir(parents=True, exist_ok=True)

    drive_mod.mount = mount
    drive_mod.flush_and_unmount = lambda *a, **k: None
    colab.drive = drive_mod
    google.colab = colab
    google.__path__ = []
    for module in (google, colab, drive_mod):  # importlib.util.find_spec (transformers asks) needs a spec
        module.__spec__ = importlib.machinery.ModuleSpec(module.__name__, None)
    monkeypatch.setitem(sys.modules, "google", google)
    monkeypatch.setitem(sys.modules, "google.colab", colab)
    monkeypatch.setitem(sys.modules, "google.colab.drive", drive_mod)
    colab.calls = calls
    return colab


@pytest.fixture(autouse=True)
def no_leaked_threads():
    """Fail a test that leaves a kit thread running (an unfinished run or store)."""
    before = {t.ident for t in threading.enumerate()}
    yield
    import time

    deadline = time.monotonic() + 5
    while True:
        leaked = [t for t in threading.enumerate() if t.ident not in before and t.name.startswith("colab_kit")
                  and t.is_alive()]
        if not leaked or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not leaked, f"threads left running: {[t.name for t in leaked]} (call run.finish()/store.close())"


@pytest.fixture(autouse=True)
def no_writes_to_colab_paths():
    """Fakes of Colab must never touch the real /content of the machine running the tests."""
    existed = Path("/content").exists()
    yield
    assert existed or not Path("/content").exists(), "a test wrote under /content"


@pytest.fixture
def fake_nvml(monkeypatch):
    """A stand-in `pynvml`: a T4-like device whose readings the test can change."""
    state = types.SimpleNamespace(name="Tesla T4", total=15 * 1024**3, used=2 * 1024**3, util=37, temp=61,
                                  power_mw=42_000, cc=(7, 5), count=1, init_error=None, used_by={})
    nvml = types.ModuleType("pynvml")

    def init():
        if state.init_error:
            raise RuntimeError(state.init_error)

    nvml.nvmlInit = init
    nvml.nvmlShutdown = lambda: None
    nvml.nvmlDeviceGetCount = lambda: state.count
    nvml.nvmlDeviceGetHandleByIndex = lambda i: ("handle", i)
    nvml.nvmlDeviceGetName = lambda h: state.name.encode()  # older bindings return bytes
    def memory(handle):  # state.used_by: {device index: bytes used} for a node of several GPUs
        used = state.used_by.get(handle[1], state.used)
        return types.SimpleNamespace(total=state.total, used=used, free=state.total - used)

    nvml.nvmlDeviceGetMemoryInfo = memory
    nvml.nvmlDeviceGetCudaComputeCapability = lambda h: state.cc
    nvml.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=state.util, memory=10)
    nvml.NVML_TEMPERATURE_GPU = 0
    nvml.nvmlDeviceGetTemperature = lambda h, sensor: state.temp
    nvml.nvmlDeviceGetPowerUsage = lambda h: state.power_mw
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return state


@pytest.fixture(scope="session")
def tiny_llama_files(tmp_path_factory) -> Path:
    """A tiny Llama-shaped model's files (tests/scripts/adapter_models.py), made once per test worker."""
    from adapter_models import save_tiny_llama

    folder = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_llama(folder)
    return folder


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """A running emulated Hugging Face Hub (tests/scripts/hub_server.py). The client must not upload through Xet
    (with hf_xet installed it does so on its own after preupload), which the emulated Hub does not speak."""
    from huggingface_hub import constants, file_download
    from huggingface_hub.utils import _http
    from hub_server import HubServer

    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_TELEMETRY", True)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf_home" / "hub"))
    # The client's own backoff (1, 2, 4, 8, 8 s between its tries) at a hundredth: the kit's retries are the
    # ones under test, and they wait on the kit's clock.
    import time

    quick = types.SimpleNamespace(**{name: getattr(time, name) for name in ("time", "monotonic", "perf_counter")},
                                  sleep=lambda seconds: time.sleep(seconds / 100))
    monkeypatch.setattr(_http, "time", quick)
    monkeypatch.setattr(file_download, "time", quick)
    with HubServer() as server:
        yield server


@pytest.fixture
def hub_env(hub, monkeypatch, tmp_path):
    """The kit's client pointed at the emulated Hub, with a token, as a notebook would have it."""
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_TOKEN", "hf_test")
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")  # for jobs in subprocesses (tiny_job.py reads it)
    return hub
