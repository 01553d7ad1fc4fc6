"""Runtime detection with faked NVML, cgroup files and Colab."""

import sys
from pathlib import Path
import types

import pytest

from colab_kit import runtime


def _meminfo(tmp_path, kib):
    path = tmp_path / "meminfo"
    path.write_text(f"MemTotal:       {kib} kB\nMemFree:        1000 kB\n")
    return path


def test_ram_limit_is_cgroup_v2_when_lower(tmp_path):
    cg = tmp_path / "cg"
    cg.mkdir()
    (cg / "memory.max").write_text(f"{12 * 1024**3}\n")
    limit = runtime.host_ram_limit(_meminfo(tmp_path, 50 * 1024**2), cg)
    assert limit == 12 * 1024**3


def test_ram_limit_cgroup_v1(tmp_path):
    cg = tmp_path / "cg"
    (cg / "memory").mkdir(parents=True)
    (cg / "memory" / "memory.limit_in_bytes").write_text(str(13_600_000_000))
    assert runtime.host_ram_limit(_meminfo(tmp_path, 50 * 1024**2), cg) == 13_600_000_000


def test_ram_limit_unlimited_cgroup_falls_back_to_memtotal(tmp_path):
    cg = tmp_path / "cg"
    (cg / "memory").mkdir(parents=True)
    (cg / "memory.max").write_text("max\n")
    (cg / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712")
    assert runtime.host_ram_limit(_meminfo(tmp_path, 8 * 1024**2), cg) == 8 * 1024**3


def test_ram_limit_memtotal_when_lower_than_cgroup(tmp_path):
    cg = tmp_path / "cg"
    cg.mkdir()
    (cg / "memory.max").write_text(str(64 * 1024**3))
    assert runtime.host_ram_limit(_meminfo(tmp_path, 4 * 1024**2), cg) == 4 * 1024**3


def _fake_nvml(monkeypatch, name="Tesla T4", total=15_360 * 1024**2, cc=(7, 5), count=1):
    nvml = types.ModuleType("pynvml")
    nvml.nvmlInit = lambda: None
    nvml.nvmlShutdown = lambda: None
    nvml.nvmlDeviceGetCount = lambda: count
    nvml.nvmlDeviceGetHandleByIndex = lambda i: ("handle", i)
    nvml.nvmlDeviceGetName = lambda h: name.encode()  # older bindings return bytes
    nvml.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(total=total, used=0, free=total)
    nvml.nvmlDeviceGetCudaComputeCapability = lambda h: cc
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    return nvml


def test_gpu_from_fake_nvml_t4(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    _fake_nvml(monkeypatch)
    gpu = runtime.gpu_info()
    assert gpu == runtime.GpuInfo("Tesla T4", 15_360 * 1024**2, (7, 5))
    assert gpu.bf16 is False


def test_gpu_from_fake_nvml_a100_has_bf16(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    _fake_nvml(monkeypatch, name="NVIDIA A100-SXM4-40GB", total=40 * 1024**3, cc=(8, 0))
    assert runtime.gpu_info().bf16 is True


def test_hidden_gpus_mean_no_gpu(monkeypatch):
    _fake_nvml(monkeypatch)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert runtime.gpu_info() is None


def test_no_nvml_and_no_cuda_means_no_gpu(monkeypatch):
    def broken_init():
        raise RuntimeError("NVML Shared Library Not Found")

    nvml = _fake_nvml(monkeypatch)
    nvml.nvmlInit = broken_init
    assert runtime.gpu_info() is None  # and PyTorch is not asked to create a CUDA context


def test_describe_mentions_fp16_on_t4(monkeypatch):
    info = runtime.RuntimeInfo(colab=True, notebook=True, gpu=runtime.GpuInfo("Tesla T4", 15 * 1024**3, (7, 5)),
                               ram_limit_bytes=int(12.7 * 1024**3))
    text = info.describe()
    assert "Google Colab" in text and "Tesla T4" in text and "bf16 no (use fp16)" in text and "12.7 GiB" in text


def test_in_colab_follows_the_google_colab_module(fake_colab, monkeypatch):
    assert runtime.in_colab()
    monkeypatch.delitem(sys.modules, "google.colab")
    monkeypatch.delenv("COLAB_RELEASE_TAG", raising=False)
    assert not runtime.in_colab()


def test_kaggle_is_recognised_and_its_runs_say_where_their_folder_survives(monkeypatch, tmp_path, capsys):
    import colab_kit as ck
    from colab_kit.run import start as start_module

    monkeypatch.delenv("KAGGLE_KERNEL_RUN_TYPE", raising=False)
    assert not runtime.in_kaggle() and not runtime.detect_runtime().kaggle
    monkeypatch.setenv("KAGGLE_KERNEL_RUN_TYPE", "Interactive")  # set by Kaggle in every kernel it starts
    info = runtime.detect_runtime()
    assert info.kaggle and not info.colab and "runtime: Kaggle" in info.describe()
    # The fast scratch goes to Kaggle's big /tmp, not to /kaggle/working (19.5 GB, all of it saved with a version).
    assert start_module._default_local_dir("r") == Path("/tmp/colab_kit_local/r")
    run = ck.start_run("r", drive=tmp_path / "drive", local_dir=tmp_path / "local", gauges=False)
    try:
        said = capsys.readouterr().out
        assert "runtime: Kaggle" in said and "there is no Google Drive here" in said and "Save Version" in said
    finally:
        run.finish(timeout=10)


def test_not_in_notebook_under_pytest():
    assert runtime.in_notebook() is False


def test_require_gpu_stops_a_gpu_preset_on_a_cpu_unless_allowed(monkeypatch):
    import colab_kit as ck
    from colab_kit.runtime import GpuInfo, require_gpu

    monkeypatch.setattr(runtime, "gpu_info", lambda: None)  # a runtime without a GPU
    with pytest.raises(ck.ColabKitError, match=r'PRESET = "full" needs a GPU.*would take about two days.*T4 GPU'
                                               r'.*ALLOW_CPU = True'):
        require_gpu('PRESET = "full"', cpu_time="about two days", gpu=None)
    require_gpu('PRESET = "full"', allow_cpu=True)  # told to: no error
    require_gpu('PRESET = "full"', gpu=GpuInfo(name="Tesla T4", total_bytes=15 << 30, compute_capability=(7, 5)))
