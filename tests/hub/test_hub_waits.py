"""Waits on the Hub are said (issue 46, path 7): start_run on a Hub that does not answer said nothing for minutes
(its retries were logged at INFO), and a new VM fetched every kept checkpoint and final/ with nothing printed
(now it fetches what the resume needs, and says bytes and files once that takes a few seconds)."""

import threading

import colab_kit as ck
from colab_kit.hub.repo import HubRepo
from colab_kit.lifecycle import hubstart
from colab_kit.tasks.demo import tiny_trainer


def trained(tmp_path, name, steps=15):
    run = ck.start_run(name, store="hf://user/runs", local_dir=tmp_path / "vm1" / name, save_every=5, keep=3,
                       gauges=False, quiet=True)
    trainer = tiny_trainer(run, max_steps=steps)
    run.train(trainer)
    run.save_final(trainer.model)
    assert run.finish(timeout=60)["in_cloud"]


def test_start_run_on_a_hub_that_does_not_answer_says_that_it_waits_and_for_how_long(hub_env, tmp_path, capsys):
    trained(tmp_path, "w")
    capsys.readouterr()
    hub_env.faults.fail_next(12, 503, endpoint="tree")  # past the client's own tries (its backoff at a hundredth)
    run = ck.start_run("w", store="hf://user/runs", local_dir=tmp_path / "vm2" / "w", gauges=False, quiet=True)
    try:
        said = capsys.readouterr().err
        assert "nothing was started" not in said and "on the Hub now (HTTP 503); trying again in 1 s" in said, said
        assert run.resume_from is not None and run.resume_from.name == "checkpoint-15"
    finally:
        run.finish(timeout=30)


def test_a_new_vm_fetches_the_newest_checkpoint_first_and_says_bytes_and_files(hub_env, tmp_path, capsys,
                                                                              monkeypatch):
    trained(tmp_path, "p")
    fetched = []
    download = HubRepo.download
    by_start = threading.current_thread()  # the older checkpoints and final/ come behind it (test_hub_fill.py)
    monkeypatch.setattr(HubRepo, "download", lambda self, paths, *a, **k: (
        fetched.extend(paths) if threading.current_thread() is by_start else None, download(self, paths, *a, **k)))
    monkeypatch.setattr(hubstart, "PULL_QUIET_S", 0.0)  # a real fill says so after 2 s; this one is quick
    capsys.readouterr()
    run = ck.start_run("p", store="hf://user/runs", local_dir=tmp_path / "vm2" / "p", gauges=False, quiet=True)
    try:
        said = capsys.readouterr().err
        assert "fetching run 'p' from the Hub:" in said and "files" in said and "KiB" in said, said
        at_start = list(fetched)
        small = [p for p in at_start if p.count("/") == 1 or p.endswith("MANIFEST.json")]
        assert at_start[:len(small)] == small  # the journal and the manifest first
        data = {p.split("/")[2] for p in at_start if p.startswith("p/checkpoints/") and not p.endswith("MANIFEST.json")}
        assert data == {"checkpoint-15"}, at_start
    finally:
        run.finish(timeout=30)
