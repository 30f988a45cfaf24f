"""The checker the test session's jaxtyping import hook applies to every annotated function and dataclass of the
project (tests/conftest.py): beartype, with an int accepted for a float (PEP 484's numeric tower). Inside
`unchecked()` nothing is checked: a test that feeds a function a wrong type on purpose, to see the function's
own validation refuse it, runs its call there."""

import contextlib
import functools
import threading

import beartype


class AnnotationViolation(UserWarning):
    """A call whose arguments or result do not match its annotations (shapes, dtypes, types)."""


_suspended = threading.local()


@contextlib.contextmanager
def unchecked():
    """Calls made inside this block (on this thread) skip the annotation checks."""
    _suspended.on = True
    try:
        yield
    finally:
        _suspended.on = False


def _switchable(check):
    """`check` as a decorator whose checks `unchecked()` suspends."""
    def decorate(fn):
        checked = check(fn)
        if isinstance(fn, type) or checked is fn:
            return checked

        @functools.wraps(fn)
        def call(*args, **kwargs):
            return (fn if getattr(_suspended, "on", False) else checked)(*args, **kwargs)

        return call

    return decorate


warn = _switchable(beartype.beartype(conf=beartype.BeartypeConf(is_pep484_tower=True,
                                                                violation_type=AnnotationViolation)))
strict = _switchable(beartype.beartype(conf=beartype.BeartypeConf(is_pep484_tower=True)))
