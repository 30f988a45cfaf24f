"""The test session's import hook checks annotated calls (tests/conftest.py): a wrong dtype fails the call by
default (JAXSEEK_TYPECHECK=strict), is reported as a warning with JAXSEEK_TYPECHECK=warn, and passes inside
`unchecked()`."""

import os

import jaxtyping
import numpy as np
import pytest

from tests.typecheck import AnnotationViolation, unchecked

MODE = os.environ.get("JAXSEEK_TYPECHECK", "strict")


@pytest.mark.skipif(MODE == "0", reason="JAXSEEK_TYPECHECK=0: nothing is checked")
def test_a_call_against_its_annotation_is_caught():
    from model.calibration import sts_confidence  # conf_logits: Float[np.ndarray, "*n"]

    assert sts_confidence(np.zeros(3, np.float32), 1.0).tolist() == [0.5] * 3  # a good call passes silently
    if MODE == "strict":
        with pytest.raises(jaxtyping.TypeCheckError, match="conf_logits"):
            sts_confidence(np.zeros(3, np.int32), 1.0)
    else:
        with pytest.warns(AnnotationViolation, match="sts_confidence"):
            sts_confidence(np.zeros(3, np.int32), 1.0)
    with unchecked():
        assert sts_confidence(np.zeros(3, np.int32), 1.0).tolist() == [0.5] * 3
