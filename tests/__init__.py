"""kinfer's tests: unit tests mirror the packages (tests/unit/<package>/test_<module>.py); integration
tests run against a real broker and Redis started on free ports."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the repository
