"""Live GPU and RAM gauges: the 1 Hz sampler (`monitor`), the gauges it feeds (`gauges`) and what
they are drawn with (`views`)."""
