"""The engine replica's KV budget: which turns run, which sessions' prefixes stay (plain logic)."""
