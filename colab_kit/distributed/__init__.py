"""Several processes, one run: which rank does what (`ranks`: the launcher's environment and the
few collectives the kit uses) and how every rank resumes from rank 0's checkpoint (`resume`)."""
