"""The hypothesis profiles of the property and schemathesis tests, registered by the root conftest.

- `ci` (the default): a bounded number of examples, derandomized (the same examples on every run)
  and no example database, so CI is deterministic and writes nothing into the checkout;
- `fast` (`nox -s tests`, the fast tier): as `ci` with a fifth of the examples;
- `deep` (`pytest --hypothesis-profile=deep tests/test_properties_*.py`): 50x the examples, random
  on every run, failures remembered under .cache/hypothesis (git-ignored) and replayed first.

Property tests size themselves with `examples(n)`: n examples under `ci`, as many times more under
another profile as its max_examples is larger.
"""

from __future__ import annotations

from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis.database import DirectoryBasedExampleDatabase

CI_EXAMPLES = 100
_QUIET = [HealthCheck.too_slow, HealthCheck.data_too_large]

settings.register_profile("ci", max_examples=CI_EXAMPLES, derandomize=True, database=None, deadline=None,
                          print_blob=True, suppress_health_check=_QUIET)
settings.register_profile("fast", settings.get_profile("ci"), max_examples=CI_EXAMPLES // 5)
settings.register_profile(
    "deep", max_examples=50 * CI_EXAMPLES, deadline=None, print_blob=True, suppress_health_check=_QUIET,
    database=DirectoryBasedExampleDatabase(Path(__file__).resolve().parents[2] / ".cache" / "hypothesis"))
settings.load_profile("ci")  # hypothesis' pytest plugin loads `--hypothesis-profile=NAME` after this


def examples(n: int) -> int:
    """n examples under the `ci` profile, scaled by the loaded profile's max_examples."""
    return max(1, n * settings.default.max_examples // CI_EXAMPLES)


def smoke() -> bool:
    """Under a profile smaller than `ci` (the fast tier): suites may also drop their unbounded phases
    (schemathesis' coverage phase)."""
    return settings.default.max_examples < CI_EXAMPLES
