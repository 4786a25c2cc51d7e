"""The conversation log: chat messages as turns, stored exactly once."""
