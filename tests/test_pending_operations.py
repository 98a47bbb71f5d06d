"""The operations nobody has taken up yet (``capyctl.scheduler.executor.pending_operations``):
what standalone's loop carries out, and, saved a while ago, what server mode's beat sends to
the workers again (their message may have been lost)."""

from datetime import timedelta

import pytest
from django.utils import timezone

from capyctl.scheduler.executor import pending_operations
from capyctl.scheduler.models import Operation
from tests.scheduling import deployment, vllm_engine


@pytest.mark.django_db
def test_pending_operations_and_those_saved_a_while_ago(gpu24):
    vllm_engine()
    alpha = deployment("alpha")
    old = Operation.objects.create(deployment=alpha, action=Operation.Action.START)
    Operation.objects.filter(pk=old.pk).update(created_at=timezone.now() - timedelta(seconds=5))
    new = Operation.objects.create(deployment=alpha, action=Operation.Action.PARK)
    done = Operation.objects.create(
        deployment=alpha, action=Operation.Action.WAKE, status=Operation.Status.DONE
    )
    Operation.objects.filter(pk=done.pk).update(created_at=timezone.now() - timedelta(seconds=5))
    assert sorted(pending_operations()) == [old.pk, new.pk]
    assert pending_operations(older_than=timedelta(seconds=2)) == [old.pk]
    for _ in range(40):
        Operation.objects.create(deployment=alpha, action=Operation.Action.STOP)
    assert len(pending_operations()) == 32  # a pass takes at most 32
