"""Conformance suite for backend authors (pytest plugin)."""
