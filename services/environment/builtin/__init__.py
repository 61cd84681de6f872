"""Environments that come with the service, addressed as `builtin:<name>` in the `env` setting."""
