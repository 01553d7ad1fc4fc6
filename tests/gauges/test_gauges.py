"""Gauges: rendering, thresholds and warnings, the summary, and the Trainer wiring."""

import time

import pytest

import colab_kit as ck
from colab_kit.checkpoints.journal import read_events
from colab_kit.gauges import gauges as gauges_mod
from colab_kit.gauges.monitor import HostReading
from colab_kit.tasks.demo import tiny_trainer


def test_live_view_shows_bars_sparklines_and_the_status_line(fake_nvml):
    g = ck.Gauges(total_steps=100, title="run 'x'", view="text", interval=0.05)
    for step in range(1, 6):
        g.update(step=step, loss=2.0 / step, saved_step=4, cloud="in the cloud: 4 (2 min old)", oom_backoffs=1,
                 micro_batch=8)
        time.sleep(0.02)
    time.sleep(0.15)
    page = g.render()
    g.close()
    assert "GPU memory" in page and "2.0 GiB / 15.0 GiB" in page and "host RAM" in page
    assert "<polyline" in page and "37 %, 61 °C, 42 W" in page
    line = g.status_line()
    assert "step 5/100" in line and "steps/s" in line and "ETA" in line and "loss 0.4" in line
    assert "checkpoint 4 saved · in the cloud: 4 (2 min old)" in line and "OOM back-offs 1 (micro-batch 8)" in line


def test_rank_0_of_several_processes_shows_every_gpu_of_its_node(fake_nvml, monkeypatch):
    fake_nvml.count, fake_nvml.used_by = 2, {0: 2 * 1024**3, 1: 9 * 1024**3}
    g = ck.Gauges(view="text", interval=10, all_gpus=True)
    page, line = g.render(), g.render_text()
    g.close()
    assert "GPU 1 memory" in page and "9.0 GiB / 15.0 GiB, busy 37 %" in page
    assert "GPU 2.0 GiB/15.0 GiB | GPU1 9.0 GiB/15.0 GiB" in line
    single = ck.Gauges(view="text", interval=10)  # one process: its own GPU only
    assert "GPU 1 memory" not in single.render()
    single.close()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")  # only GPU 1 visible: nothing else to show
    g = ck.Gauges(view="text", interval=10, all_gpus=True)
    assert "GPU 1 memory" not in g.render() and "9.0 GiB / 15.0 GiB" in g.render()
    g.close()


def test_na_everywhere_without_a_gpu(fake_nvml):
    fake_nvml.init_error = "no driver"
    g = ck.Gauges(view="text", interval=10)
    page = g.render()
    g.close()
    assert page.count("n/a") >= 3


def test_gpu_near_full_turns_red_and_warns_once_per_crossing(fake_nvml):
    warned = []
    g = ck.Gauges(view="text", interval=0.02, on_warn=warned.append)
    fake_nvml.used = int(0.97 * fake_nvml.total)
    time.sleep(0.2)
    assert len(warned) == 1 and "GPU memory at 97%" in warned[0]
    assert gauges_mod._COLORS["red"] in g.render() and "⚠" in g.render()
    fake_nvml.used = int(0.5 * fake_nvml.total)  # re-armed below the threshold
    time.sleep(0.2)
    fake_nvml.used = int(0.99 * fake_nvml.total)
    time.sleep(0.2)
    g.close()
    assert len(warned) == 2


def test_host_ram_near_its_limit_warns_before_the_kernel_dies(fake_nvml, monkeypatch):
    monkeypatch.setattr("colab_kit.gauges.monitor.read_host",
                        lambda limit=None, **k: HostReading(rss=1, peak_rss=1, used=int(11.6 * 1024**3),
                                                            limit=int(12.7 * 1024**3)))
    warned = []
    g = ck.Gauges(view="text", interval=0.02, on_warn=warned.append)
    time.sleep(0.1)
    g.close()
    assert warned and "host RAM at 91% of 12.7 GiB" in warned[0] and "killed" in warned[0]


def test_summary_stays_is_saved_and_is_red_on_error(fake_nvml, tmp_path, capsys):
    with ck.Gauges(view="text", interval=0.02, save_html=tmp_path / "gauges.html") as g:
        g.update(step=3, loss=0.5)
        time.sleep(0.1)
    saved = (tmp_path / "gauges.html").read_text()
    assert "colab_kit gauges summary" in saved and "peak GPU memory" in saved and "finished" in saved
    assert "finished" in capsys.readouterr().err
    with pytest.raises(ValueError):
        with ck.Gauges(view="text", interval=0.02) as g:
            raise ValueError("data loader broke")
    html_text, text = g.summary("ValueError: data loader broke")
    assert gauges_mod._COLORS["red"] in html_text and "failed: ValueError" in text
    assert g.close() == g.close()  # idempotent


def test_plot_history_draws_memory_and_loss(fake_nvml):
    import matplotlib

    matplotlib.use("Agg")
    g = ck.Gauges(view="text", interval=0.02)
    for step in range(5):
        g.update(step=step, loss=1.0 / (step + 1))
        time.sleep(0.03)
    g.close()
    fig = ck.plot_history()
    titles = [axis.get_title() for axis in fig.axes]
    assert titles == ["GPU memory", "host RAM", "loss"]
    assert len(fig.axes[2].lines[0].get_xdata()) == 5


def test_run_train_shows_gauges_writes_the_summary_and_journals_warnings(fake_nvml, drive, local):
    fake_nvml.used = int(0.99 * fake_nvml.total)
    run = ck.start_run("g", drive=drive, local_dir=local, save_every=10, quiet=True)
    run.train(tiny_trainer(run, max_steps=20))
    assert "colab_kit gauges summary" in (drive / "g" / "gauges.html").read_text()
    warns = [e for e in read_events(drive / "g" / "events.jsonl") if e["event"] == "warn" and e["what"] == "memory"]
    assert warns and "GPU memory at 99%" in warns[0]["message"]


def test_gauges_can_be_turned_off(drive, local):
    run = ck.start_run("off", drive=drive, local_dir=local, gauges=False, quiet=True)
    run.train(tiny_trainer(run, max_steps=3))
    assert not (drive / "off" / "gauges.html").exists()
    from colab_kit.trainer.callbacks import GaugesCallback

    assert not any(isinstance(cb, GaugesCallback) for cb in run.callbacks())


def test_a_failed_training_leaves_a_red_summary(drive, local):
    from transformers import TrainerCallback

    class Boom(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 3:
                raise RuntimeError("loss is NaN")

    run = ck.start_run("red", drive=drive, local_dir=local, quiet=True)
    trainer = tiny_trainer(run, max_steps=10)
    trainer.add_callback(Boom())
    with pytest.raises(RuntimeError):
        run.train(trainer)
    saved = (drive / "red" / "gauges.html").read_text()
    assert "failed: RuntimeError: loss is NaN" in saved and gauges_mod._COLORS["red"] in saved
