"""How a model gives back its GPU memory when another needs room (DESIGN §5), and what a
park leaves on the GPU: the decision table the policy (:mod:`capyctl.scheduler.policy`)
reads for each victim. Plain data in, an answer out: no database, no clock."""

from __future__ import annotations

from capyctl.scheduler.placement_data import (
    DEEP,
    MIN_RESIDUAL_BYTES,
    RAM,
    RESIDUAL_SHARE,
    STOP,
    HostSnapshot,
    Resident,
)


def expected_residual(resident: Resident, held: int) -> int:
    if resident.residual_bytes is not None:
        return min(resident.residual_bytes, held)
    return min(held, max(int(held * RESIDUAL_SHARE), MIN_RESIDUAL_BYTES))


def park_mode(  # noqa: PLR0911 - a decision table reads best as early answers
    resident: Resident, host: HostSnapshot, ram_free: int
) -> tuple[str, str]:
    """The best mode ``resident`` allows here, and why (for the event and the log)."""
    policy = resident.park_policy
    ram_allowed = policy in ("auto", RAM) and resident.can_park_ram and not host.unified
    deep_allowed = policy in ("auto", RAM, DEEP) and resident.can_park_deep
    if resident.parks_unverified and (ram_allowed or deep_allowed):
        return STOP, "its engine's last park did not free its GPU memory"
    if ram_allowed and resident.weights_bytes <= ram_free:
        return RAM, "its weights copy fits in host RAM"
    if deep_allowed:
        if host.unified and policy in ("auto", RAM) and resident.can_park_ram:
            return DEEP, "on unified memory a RAM copy would come out of the same pool"
        if ram_allowed:
            return DEEP, (
                f"its copy ({gib(resident.weights_bytes)}) would not fit in host RAM "
                f"({gib(ram_free)} free)"
            )
        return DEEP, "it parks deep"
    refused = resident.deep_refused and policy in ("auto", RAM, DEEP)
    if ram_allowed:
        return STOP, (
            f"its copy ({gib(resident.weights_bytes)}) would not fit in host RAM "
            f"({gib(ram_free)} free)"
        ) + (f", and it may not park deep: {resident.deep_refused}" if refused else "")
    if refused:
        return STOP, f"it may not park deep: {resident.deep_refused}"
    if policy in (STOP, "never"):
        return STOP, f"its park policy is {policy}"
    return STOP, "its engine cannot park"


def gib(num_bytes: int) -> str:
    return f"{num_bytes / 1024**3:.1f} GiB"
