"""The durable job queue and the worker that runs it."""
