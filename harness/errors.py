"""Errors that the command-line front ends turn into one clear message and exit status 2."""


class UserError(Exception):
    """Bad input from the user: reported as one message (what, where, what to do), exit status 2."""

    exit_status = 2


class SpecError(UserError):
    """An invalid job spec; names the file and the field."""

    def __init__(self, message: str, field: str | None = None, source: str | None = None):
        self.field = field
        self.source = source
        where = " ".join(part for part in (source and f"{source}:", field and f"[{field}]") if part)
        super().__init__(f"{where} {message}".strip())
