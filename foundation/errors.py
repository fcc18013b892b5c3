"""Errors every layer raises."""


class ConfigError(ValueError):
    """A config value that cannot work; the message starts with the key."""
