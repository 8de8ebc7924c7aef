"""pytest plugin entry point: fixtures for the conformance suite."""
