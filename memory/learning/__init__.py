"""Learned memory: facts, summaries and the profile, and the jobs that learn them."""
