"""Test support: the scripted upstream and the helpers tests share."""
