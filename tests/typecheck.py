"""The checker the test session's jaxtyping import hook applies to every annotated function and dataclass of the
project (tests/conftest.py): beartype, with an int accepted for a float (PEP 484's numeric tower)."""

import beartype


class AnnotationViolation(UserWarning):
    """A call whose arguments or result do not match its annotations (shapes, dtypes, types)."""


warn = beartype.beartype(conf=beartype.BeartypeConf(is_pep484_tower=True, violation_type=AnnotationViolation))
strict = beartype.beartype(conf=beartype.BeartypeConf(is_pep484_tower=True))
