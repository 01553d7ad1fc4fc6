"""Readers with fake NVML and fake cgroup files; the bounded history."""

import shutil

from colab_kit.gauges.monitor import (
    GpuReading,
    History,
    Sample,
    Sampler,
    _Nvml,
    read_disk,
    read_gpu,
    read_host,
    read_torch,
)


def test_gpu_reading_from_fake_nvml(fake_nvml):
    nvml = _Nvml()
    reading = read_gpu(nvml)
    nvml.close()
    assert reading == GpuReading(used=2 * 1024**3, total=15 * 1024**3, util=37.0, temperature=61.0, power=42.0)


def test_no_nvml_means_every_gpu_field_is_na(fake_nvml):
    fake_nvml.init_error = "NVML Shared Library Not Found"
    assert read_gpu(_Nvml()) == GpuReading()


def test_a_failing_field_is_na_and_the_rest_still_read(fake_nvml):
    import sys

    def broken(handle):
        raise RuntimeError("not supported on this device")

    sys.modules["pynvml"].nvmlDeviceGetPowerUsage = broken
    reading = read_gpu(_Nvml())
    assert reading.power is None and reading.used == 2 * 1024**3


def test_torch_allocator_is_not_asked_without_an_initialised_cuda():
    import torch

    assert not torch.cuda.is_initialized()
    assert read_torch().allocated is None
    assert not torch.cuda.is_initialized()  # reading did not create a context


def _cgroup_v2(root, current, inactive, limit):
    root.mkdir(parents=True, exist_ok=True)
    (root / "memory.current").write_text(f"{current}\n")
    (root / "memory.stat").write_text(f"anon 123\ninactive_file {inactive}\nactive_file 5\n")
    (root / "memory.max").write_text(f"{limit}\n")


def test_host_used_is_the_cgroup_v2_working_set(tmp_path):
    _cgroup_v2(tmp_path / "cg", current=9 * 1024**3, inactive=2 * 1024**3, limit=12 * 1024**3)
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal: {50 * 1024**2} kB\n")
    reading = read_host(meminfo, tmp_path / "cg")
    assert reading.used == 7 * 1024**3 and reading.limit == 12 * 1024**3
    assert reading.rss > 0 and reading.peak_rss >= reading.rss // 2


def test_host_used_from_cgroup_v1(tmp_path):
    v1 = tmp_path / "cg" / "memory"
    v1.mkdir(parents=True)
    (v1 / "memory.usage_in_bytes").write_text(str(5 * 1024**3))
    (v1 / "memory.stat").write_text(f"cache 1\ntotal_inactive_file {1024**3}\n")
    (v1 / "memory.limit_in_bytes").write_text(str(13 * 1024**3))
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal: {50 * 1024**2} kB\n")
    reading = read_host(meminfo, tmp_path / "cg")
    assert reading.used == 4 * 1024**3 and reading.limit == 13 * 1024**3


def test_without_cgroup_files_the_machine_numbers_are_used(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal: {8 * 1024**2} kB\n")
    reading = read_host(meminfo, tmp_path / "none")
    assert reading.limit == 8 * 1024**3 and reading.used > 0


def test_disk_free_and_na_for_missing_folders(tmp_path):
    reading = read_disk(tmp_path, tmp_path / "not-there")
    assert reading.local_free == shutil.disk_usage(tmp_path).free or reading.local_free > 0
    assert reading.drive_free is None


def test_history_stays_bounded_covers_the_run_and_keeps_exact_peaks():
    history = History(capacity=16)
    for i in range(100):
        history.add(Sample(t=float(i), gpu=GpuReading(used=i if i != 37 else 10_000, total=20_000)))
    assert len(history.samples) <= 16
    assert history.samples[0].t == 0.0 and history.samples[-1].t >= 90
    assert history.peaks["gpu_used"] == 10_000


def test_sampler_thread_samples_and_stops(fake_nvml):
    import time

    history = History()
    seen = []
    sampler = Sampler(history, on_sample=seen.append, interval=0.02)
    sampler.start()
    deadline = time.monotonic() + 5
    while len(seen) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    sampler.stop()
    assert len(seen) >= 3 and seen[0].gpu.total == 15 * 1024**3
