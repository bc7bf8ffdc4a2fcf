"""Formats: storage and the readers of every format."""
