"""Serving logic per endpoint family (no web framework here; routes live in actors/)."""
