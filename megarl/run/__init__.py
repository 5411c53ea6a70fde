"""A run's services: metrics and mlflow (tracking), signals (interrupt), the run directory's lock, profiling,
and how a command ends (errors as one paragraph, interrupts as exit codes)."""
