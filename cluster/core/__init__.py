"""The I/O-free core, grouped by concern.

- `websocket/`: WebSocket mode's per-connection session (lanes, FIFO, steering, inject).
- `turn/`: one turn (driver, stream, context, controls, state and its cache, post-work).
- `render/`: items to chat messages and prompt tokens, incremental, probed at start.
- `safety/`: classifiers and the per-turn gate.
- `messages.py`, `events.py`, `retry.py`: the typed messages between layers, the event
  assembler, the one retry policy.

Nothing here imports Ray, opens a socket or loads a model. Lower layers never import
higher ones (`tests/unit/test_layout.py` holds the order).
"""
