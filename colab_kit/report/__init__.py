"""The run folder explained to a person: a status page and a picture beside the run's files (issue 49)."""
