"""The embedded heartbeat tracker: SQLite store (store.py), HTTP API v1 (app.py, documented in API.md)."""
