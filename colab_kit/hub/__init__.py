"""The Hugging Face Hub as a run's store (`start_run(store="hf://<user>/<repo>")`, for Kaggle and everywhere
without Google Drive): `address` (what `hf://` names), `token` (found on the main thread), `repo` (the
real `huggingface_hub` client, each write a commit on a known parent, lost answers sorted out), `lease`
(one writer per run, every commit fenced by the Hub's compare-and-swap), `verify` (in the cloud = the
listing's LFS sha256 equals the manifest's).
"""
