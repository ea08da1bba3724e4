"""The HTTP API and the web console: a thin layer over the application service."""
