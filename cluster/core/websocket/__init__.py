"""WebSocket mode: the per-connection session, its lanes, steering and multi-agent inbox."""
