"""Hypothesis profiles, chosen on purpose.

CI sets CI=true, which makes Hypothesis load its built-in ``ci`` profile
(derandomized, no example database). We derive our own CI profile from it
so the run is reproducible, and a dev profile from the default one. A deeper
profile for long runs is picked with BUBBLEFREE_PROFILE=deep.

Every test skipped where the GPU's parts are missing (a skip whose reason
names CUDA, a GPU, Triton or sm_90) is marked ``gpu``, so ``pytest -m gpu``
runs all of them on a GPU machine (``bench/gpu_run.sh``) and no list of
files goes stale. A file that cannot import an optional extra's package
(FastAPI, the clients) is skipped with the extra's name there, and is an
error under CI, which installs them all.
"""

import os
import re

import pytest
from hypothesis import HealthCheck, settings
from optional_extras import skip_reason

GPU_REASON = re.compile(r"CUDA|GPU|Triton|sm_90")


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """A test file that cannot import an optional extra's package is
    skipped, naming the extra, outside CI (``optional_extras``)."""
    report = (yield).get_result()
    if report.failed and isinstance(collector, pytest.Module):
        reason = skip_reason(str(report.longrepr), bool(os.environ.get("CI")))
        if reason:
            report.outcome = "skipped"
            report.longrepr = (str(collector.path), 0, f"Skipped: {reason}")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if any(GPU_REASON.search(str(mark.kwargs.get("reason", "")))
               for mark in item.iter_markers("skipif")):
            item.add_marker(pytest.mark.gpu)

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
