"""Thin I/O edges between the outside world and the core engine."""
