"""Tests of the launcher helpers: auto-config and the node check."""
