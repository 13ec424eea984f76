"""Hypothesis profiles, chosen on purpose.

CI sets CI=true, which makes Hypothesis load its built-in ``ci`` profile
(derandomized, no example database). We derive our own CI profile from it
so the run is reproducible, and a dev profile from the default one. A deeper
profile for long runs is picked with BUBBLEFREE_PROFILE=deep.
"""

import os

from hypothesis import HealthCheck, settings

_slow = [HealthCheck.too_slow, HealthCheck.data_too_large]

settings.register_profile(
    "bubblefree-ci", parent=settings.get_profile("ci"),
    max_examples=150, deadline=None, suppress_health_check=_slow)
settings.register_profile(
    "bubblefree-dev", parent=settings.get_profile("default"),
    max_examples=100, deadline=None, suppress_health_check=_slow)
settings.register_profile(
    "bubblefree-deep", parent=settings.get_profile("default"),
    max_examples=3000, deadline=None, suppress_health_check=_slow)

_chosen = os.environ.get("BUBBLEFREE_PROFILE")
if _chosen:
    settings.load_profile(f"bubblefree-{_chosen}")
elif os.environ.get("CI"):
    settings.load_profile("bubblefree-ci")
else:
    settings.load_profile("bubblefree-dev")
