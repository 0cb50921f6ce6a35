"""The one exception type for bad configuration."""


class ConfigError(ValueError):
    """A configuration mistake, described in one sentence that says what to change.

    Raised before any process group, Ray actor or file write starts, so a bad config
    costs nothing and loses nothing.
    """
