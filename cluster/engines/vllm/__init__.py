"""The vLLM backend: the engine adapter, session pins in its scheduler, forced output, grammar compiles."""
