"""User-facing errors.

Every mistake a user can make (bad path, bad size, empty prompt, unwritable cache, ...) raises a
subclass of :class:`CarnatorError` with a one-line message. The CLI prints that line and exits
non-zero; it never shows a traceback for these.
"""


class CarnatorError(Exception):
    """A problem the user can fix; ``str(err)`` is a one-line explanation."""


class InvalidRequestError(CarnatorError, ValueError):
    """The request asks for something the model cannot do (empty prompt, bad size, ...)."""


class ModelLoadError(CarnatorError):
    """The model path or pipeline object cannot be used."""


class CacheError(CarnatorError):
    """The cache directory cannot be used (unwritable, written by an incompatible version, ...)."""


class GenerationError(CarnatorError):
    """The model could not produce a usable video for this request (e.g. non-finite values); nothing is stored."""


class CorruptEntryError(Exception):
    """A cache entry failed its checksum; the bank quarantines it and treats it as a miss."""


class Cancelled(Exception):
    """A request stopped at a step boundary because its caller cancelled it; nothing of it is stored."""
