"""What is scored, above core/ and below the stages: the probes (arithmetic, brackets, ...), their grading, and the
benchmark and prompt rows (the shared mirror or the hub)."""
