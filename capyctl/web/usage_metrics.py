"""What the usage record and budgets say, for ``/metrics``: tokens and GPU-seconds by
team and model (every API process's, summed from the database), and how much of each
budget its period has used. Labels name teams, models and budgets (a key by its public
id), never a secret."""

from __future__ import annotations

from collections.abc import Iterator

from django.db.models import Sum
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from capyctl.access import budgets
from capyctl.access.models import Budget, Usage

NO_TEAM = ""  # the team label of keys charged to none


def budget_label(budget: Budget) -> str:
    """``team:research:day``, ``user:ana:month``, ``key:capy_m8x6ps774i:total``."""
    scope, of = budgets.whose(budget).split(" ", 1)
    return f"{scope}:{of}:{budget.period}"


class UsageCollector(Collector):
    def collect(self) -> Iterator[Metric]:
        tokens = CounterMetricFamily(
            "capyctl_tokens", "tokens /v1 requests used, by team, model and direction",
            labels=["team", "model", "direction"],
        )  # fmt: skip
        gpu = CounterMetricFamily(
            "capyctl_gpu_seconds",
            "GPU-seconds /v1 requests used (their switches' shares included), by team and model",
            labels=["team", "model"],
        )
        rows = Usage.objects.values("team__name", "model").annotate(
            prompt=Sum("prompt_tokens"), completion=Sum("completion_tokens"),
            held=Sum("gpu_seconds"), switch=Sum("switch_gpu_seconds"),
        )  # fmt: skip
        for row in rows.order_by("team__name", "model"):
            team = row["team__name"] or NO_TEAM
            tokens.add_metric([team, row["model"], "prompt"], row["prompt"] or 0)
            tokens.add_metric([team, row["model"], "completion"], row["completion"] or 0)
            gpu.add_metric([team, row["model"]], (row["held"] or 0) + (row["switch"] or 0))
        yield tokens
        yield gpu
        used = GaugeMetricFamily(
            "capyctl_budget_used_ratio",
            "how much of each budget its current period has used (the largest of its tokens', "
            "GPU-seconds' and spend's shares; 1 or more: used up)",
            labels=["budget"],
        )
        found = list(Budget.objects.select_related("key", "user", "team").order_by("pk"))
        all_used = budgets.used_of_many(found)
        for budget in found:
            spent = all_used[budget.pk]
            shares = []
            if budget.tokens:
                shares.append(spent.tokens / budget.tokens)
            if budget.gpu_seconds:
                shares.append(spent.gpu_seconds / budget.gpu_seconds)
            if budget.spend:
                shares.append(spent.spend / budget.spend)
            used.add_metric([budget_label(budget)], round(max(shares, default=0.0), 4))
        yield used
