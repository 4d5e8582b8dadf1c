"""The scripted backend: a deterministic engine standing in for a GPU one (tests, benchmarks)."""
