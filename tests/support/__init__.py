"""What the tests share: one WebSocket client (`ws`), the app configs they deploy (`apps`)."""
