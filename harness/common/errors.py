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


class WriteError(UserError):
    """A file that could not be written (a full disk, a read-only or unwritable folder): names the folder and, for a
    full disk, the bytes the file needs and the bytes free (harness.common.output.write_failure builds it)."""

    def __init__(self, message: str, path: str, disk_full: bool = False):
        self.path = path
        self.disk_full = disk_full
        super().__init__(message)
