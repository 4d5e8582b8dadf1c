"""The I/O-free core: session cache, context resolution, event assembly, parsing.

Nothing here imports Ray, opens a socket or loads a model.
"""
