"""A run's life under its public face: the checkpoint it resumes from (`find`, `fresh`, `best`, `drift`), a
run kept on the Hugging Face Hub (`hubstart`, `hubstatus`), the runs this process has open (`registry`), and the
end of a run (`finish`)."""
