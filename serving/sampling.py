"""The sampling parameters' short import path: `from serving.sampling import SamplingParams`
(`serving.base.sampling`)."""
from serving.base.sampling import SamplingParams  # noqa: F401
