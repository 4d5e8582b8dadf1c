"""Safety: classifiers and the per-turn gate."""
