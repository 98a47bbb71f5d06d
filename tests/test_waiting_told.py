"""When a wait for room is an event: once it lasts, not on a first refusal that the next
try, a moment later, gets past (simulated 24 GiB GPU, simulated engines, in process)."""

import pytest

from capyctl.events.models import Event
from capyctl.scheduler import actions, requests_in_progress, steps
from tests.scheduling import deployment, state, vllm_engine


@pytest.mark.django_db(transaction=True)
def test_a_model_asked_right_after_anothers_answer_is_not_told_to_wait(
    gpu24, settings, monkeypatch
):
    """The demo: sim-a answers, and sim-b is asked the next moment. sim-a counts as busy
    for a moment after its last request (the busy grace, widened here so the first try
    surely falls in it), so the first try for b was refused; the next parked a. The events
    said "b ... waits for room; in the way: a (busy, its turn: 30 s left)" and, the same
    second, "parked a": a wait that never happened. Now only the park is told."""
    monkeypatch.setattr(steps, "BUSY_GRACE_SECONDS", 0.5)
    settings.CAPYCTL = {**settings.CAPYCTL, "MAX_TURN_SECONDS": 30}
    vllm_engine()
    a, b = deployment("a"), deployment("b")
    actions.ensure_ready(a.pk)
    assert requests_in_progress.begin(a.pk)
    requests_in_progress.end(a.pk)  # a has just answered
    assert actions.ensure_ready(b.pk).observed_state == "ready"
    assert state("a") == ("parked", "ram")
    told = list(Event.objects.filter(subject="b").values_list("kind", flat=True))
    assert "deployment.waiting" not in told, told
    parked = Event.objects.get(kind="deployment.parked", subject="a")
    assert parked.message == "parked a (ram) to make room for b"
