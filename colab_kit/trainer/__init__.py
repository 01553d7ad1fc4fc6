"""The HF Trainer's side of a run: `run.train` (`training`), the kit's callbacks (`callbacks`), the Trainer's save
settings beside the kit's saves (`savesettings`), the stop button (`stop`), settings changed on resume (`changes`),
and the local disk before a save (`disk`)."""
