"""The REST API under ``/api/``: the same service layer as the CLI and the admin."""
