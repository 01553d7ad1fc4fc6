"""The run's public face: `start_run` (`start`, its arguments `startargs`, what it prints `summary`), the `Run`
object (`run`), what a run folder holds (`status`), and the session's end (`release`). What lies under it has rooms
of its own: `lifecycle/`, `trainer/`, `loop/`, `export/`."""
