"""The exceptions a run ends with in one sentence: a bad config (exit 2), or a run that cannot go on (exit 1)."""


class ConfigError(ValueError):
    """A configuration mistake, described in one sentence that says what to change.

    Raised before any process group, Ray actor or file write starts, so a bad config
    costs nothing and loses nothing.
    """


class RunError(RuntimeError):
    """A run that cannot go on for a reason outside its config (a rank lost, devices never offered),
    described in one sentence that says what happened and how to go on."""
