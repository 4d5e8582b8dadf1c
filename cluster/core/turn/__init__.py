"""One turn: driver, event stream, context resolution, output controls, response state and its cache."""
