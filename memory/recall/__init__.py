"""Recall: query building, lexical term choice, ranking, and the memory block."""
