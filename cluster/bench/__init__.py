"""The agent-loop benchmark (`loopserve bench`)."""
