"""Typed exceptions for user-facing errors: each carries one clear line for the CLI to print."""


class BeamtrtError(Exception):
    """Base class: a user mistake or bad input, reported as one line without a traceback."""


class ConfigError(BeamtrtError):
    """A config.json (or a flag) is unreadable, has unknown fields, or is inconsistent."""


class CheckpointError(BeamtrtError):
    """A checkpoint is missing, corrupt, incomplete, or holds tensors of the wrong shape, dtype or value."""


class DeviceError(BeamtrtError):
    """What the command needs is not on this host: a GPU, a compiler, a built kernel library."""
