"""The run that ties the rooms below together: `start_run` (`start`), the `Run` object (`run`),
training through the HF Trainer (`training`, `callbacks`, `best`), the exported model (`final`),
the end of a run (`finish`), the runs this process has open (`registry`), what a run folder holds
(`status`), and the same durability for plain PyTorch loops (`store`)."""
