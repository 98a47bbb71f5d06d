"""The settings a person may give a deployment, each declared once.

Every entry point is built from :data:`SETTINGS`: the model's validators and help, the
service's range checks, the REST serializer's input and output fields, the admin's fields
and fieldsets, the ``deployment add`` and ``deployment update`` flags, the listings
(``capyctl deployment list --json``, the REST output) and the what-if model's defaults.

A setting whose ``default`` is None takes the global default ``settings.CAPYCTL[KEY]``
(``KEY`` is its name in capitals) while its own value is empty; ``builtin`` is that global
default's value when no environment variable sets it.

Only staff (or an ``admin`` key) change deployments, on every entry point: ``who`` says so
for each setting, for a setting that others may one day set.

What a deployment *is* rather than how it behaves (its name, aliases, engine, host, source,
engine args, memory figures, media domains) has its own parsing on each entry point and
is not declared here.

Plain Python, no Django: the CLI parser reads it.
"""

from __future__ import annotations

from dataclasses import dataclass

from capyctl.deployments import guards

MAX_GPUS = 64
MAX_REPLICAS = 64
MAX_SECONDS = 10**9  # about 31 years, within the 32-bit columns that hold them
MAX_COUNT = 2**31 - 1
MAX_PRIORITY = 1000
MAX_ADAPTER_SLOTS = 256
MAX_ADAPTER_RANK = 512

STAFF = "staff"  # who may set it: staff users and admin keys

# The admin's fieldsets, in the order they show.
MEMORY = "Memory"
PARKING = "Parking and waiting"
REQUESTS = "What a request may ask"
PRICES = "Prices"
SECTIONS = (MEMORY, PARKING, REQUESTS, PRICES)

COUNT = "count"  # a whole number within its bounds
CHOICE = "choice"  # one of its choices
FLAG = "bool"  # on or off
PRICE = "price"  # an amount of money, 0 or more, in the operator's own currency
MAX_PRICE = 1_000_000


@dataclass(frozen=True)
class Setting:
    """One deployment setting: the Deployment field (and spec, REST and JSON field) ``name``,
    what values it takes, its default, its help and its command-line flag."""

    name: str
    kind: str
    help: str
    section: str
    default: int | str | bool | None = None  # None: the global default (settings.CAPYCTL)
    builtin: int | None = None  # the global default where no environment variable sets it
    minimum: int | None = None
    maximum: int | None = None
    choices: tuple[str, ...] = ()
    label: str = ""  # how an error names it (default: its name in words)
    flag_name: str = ""  # the CLI flag (default: --NAME with dashes)
    metavar: str | None = None  # the CLI's placeholder (None: argparse's)
    default_words: str = ""  # how the CLI's help says its default (default: "default X")
    # Where an entry point asked for more than the model holds to, it still does:
    flag_minimum: int | None = None  # the least the CLI flag takes (None: minimum)
    api_minimum: int | None = None  # the least the REST field takes (None: minimum)
    # A global default of 0 that means "this other setting's value".
    zero_means: str | None = None
    # Its flag also takes LOW:VALUE, LOW going to this other setting (VALUE alone sets
    # that one to 0): --replicas MIN:MAX.
    low_part: str | None = None
    on_cli: bool = True  # False: no flag of its own (set through another's low_part)
    who: str = STAFF

    @property
    def global_key(self) -> str | None:
        """The key of its global default in ``settings.CAPYCTL`` (None: a fixed default)."""
        return self.name.upper() if self.default is None else None

    @property
    def nullable(self) -> bool:
        """Whether it may be left empty (and so take the global default)."""
        return self.default is None

    @property
    def flag(self) -> str:
        return self.flag_name or "--" + self.name.replace("_", "-")

    @property
    def dest(self) -> str:
        """The argparse namespace name of its flag."""
        return self.flag.removeprefix("--").replace("-", "_")

    @property
    def words(self) -> str:
        return self.label or self.name.replace("_", " ")

    @property
    def least_flag(self) -> int | None:
        """The least its CLI flag takes (None: any whole number)."""
        return self.flag_minimum if self.flag_minimum is not None else self.minimum

    @property
    def least_api(self) -> int | None:
        """The least its REST field takes (None: no bound of its own)."""
        return self.api_minimum if self.api_minimum is not None else self.minimum

    def model_help(self) -> str:
        """The model field's help (the admin shows it): an empty one says what stands in."""
        return f"{self.help} (empty: the global default)" if self.nullable else self.help

    def cli_help(self) -> str:
        """The CLI flag's help: what it does, and its default."""
        if self.default_words:
            return f"{self.help} ({self.default_words})"
        if self.kind == FLAG:
            return self.help
        shown = self.default if self.default is not None else self.builtin
        return f"{self.help} (default {shown})"

    def check(self, value: object) -> str | None:
        """Why ``value`` cannot be this setting (None: it can). Empty (None) is fine where
        the global default stands in."""
        if value is None and self.nullable:
            return None
        if self.kind == CHOICE:
            wrong = value not in self.choices
            return (
                f"invalid {self.words} {value!r} (use {', '.join(self.choices)})" if wrong else None
            )
        if self.kind == FLAG:
            return None if isinstance(value, bool) else f"invalid {self.words} {value!r}"
        if self.kind == PRICE:
            return _price_wrong(self.words, value)
        low, high = self.minimum, self.maximum
        if (
            type(value) is not int
            or not (low is None or low <= value)
            or not (high is None or value <= high)
        ):
            return f"invalid {self.words} {value!r}: use {low} to {high}"
        return None


def _price_wrong(words: str, value: object) -> str | None:
    if type(value) in (int, float) and 0 <= value <= MAX_PRICE:  # type: ignore[operator]
        return None
    return f"invalid {words} {value!r}: use 0 to {MAX_PRICE:,}"


def _ceiling(ceiling: guards.Ceiling) -> Setting:
    return Setting(
        ceiling.name, COUNT, ceiling.help, REQUESTS, default=ceiling.default, minimum=1,
        maximum=guards.MAX_CEILING, flag_name=ceiling.flag, metavar="N",
    )  # fmt: skip


PARK_POLICIES = ("auto", "ram", "deep", "stop", "never")
OVER_CLAIM_CHOICES = ("stop", "raise")
SPREAD_CHOICES = ("hosts", "gpus")
ROUTING_CHOICES = ("affinity", "least-load")

# In the order listings show them, and the admin within each of its sections.
SETTINGS: tuple[Setting, ...] = (
    Setting(
        "gpus", COUNT, "GPUs of one host it needs", MEMORY, default=1, minimum=0, maximum=MAX_GPUS
    ),
    Setting(
        "replicas",
        COUNT,
        "engines that serve it, each on GPUs of its own: N (N kept up) or MIN:MAX (MIN kept "
        "up, more brought up by load, up to MAX)",
        MEMORY,
        default=1,
        minimum=1,
        maximum=MAX_REPLICAS,
        metavar="N|MIN:MAX",
        low_part="min_replicas",
        default_words="default 1",
    ),
    Setting(
        "min_replicas",
        COUNT,
        "replicas kept up while it serves, whatever the load (0: all of its replicas); the "
        "rest are brought up by load",
        MEMORY,
        default=0,
        minimum=0,
        maximum=MAX_REPLICAS,
        label="minimum replicas",
        on_cli=False,
    ),
    Setting(
        "target_concurrency",
        COUNT,
        "requests in flight on each ready replica, on average, past which one more is brought up",
        MEMORY,
        builtin=8,
        minimum=1,
        maximum=MAX_COUNT,
        metavar="N",
    ),
    Setting(
        "scale_up_wait_seconds",
        COUNT,
        "a request that has waited this long for its answer to begin calls for one more replica",
        MEMORY,
        builtin=5,
        minimum=1,
        maximum=MAX_SECONDS,
        metavar="N",
    ),
    Setting(
        "spread",
        CHOICE,
        "where its replicas go: hosts (fewest of its replicas on a host first) or gpus (any "
        "free GPUs, the same host's included)",
        MEMORY,
        default="hosts",
        choices=SPREAD_CHOICES,
    ),
    Setting(
        "routing",
        CHOICE,
        "how a request picks among its ready replicas: affinity (the same session or prompt "
        "start to the same replica, within a load bound) or least-load",
        MEMORY,
        default="affinity",
        choices=ROUTING_CHOICES,
    ),
    Setting(
        "adapter_slots",
        COUNT,
        "adapters (LoRA fine-tunes named as models of their own) its engine holds on the GPU "
        "at once; its engine reserves their memory at start (0: it serves none)",
        MEMORY,
        default=0,
        minimum=0,
        maximum=MAX_ADAPTER_SLOTS,
        metavar="N",
    ),
    Setting(
        "adapter_max_rank",
        COUNT,
        "the largest LoRA rank of its adapters, which sizes each slot (0: the engine's own "
        "default)",
        MEMORY,
        default=0,
        minimum=0,
        maximum=MAX_ADAPTER_RANK,
        metavar="R",
    ),
    Setting(
        "park",
        CHOICE,
        "how it gives back GPU memory when another model needs room",
        PARKING,
        default="auto",
        choices=PARK_POLICIES,
        label="park policy",
    ),
    Setting("pinned", FLAG, "never parked or stopped to make room", PARKING, default=False),
    Setting(
        "over_claim",
        CHOICE,
        "an engine measured past its GPU memory claim at start: stop it, or raise the claim "
        "to what it holds",
        MEMORY,
        default="stop",
        choices=OVER_CLAIM_CHOICES,
        label="over-claim",
    ),
    Setting(
        "priority",
        COUNT,
        "higher stays loaded longer",
        PARKING,
        default=0,
        minimum=-MAX_PRIORITY,
        maximum=MAX_PRIORITY,
    ),
    Setting(
        "idle_park_seconds",
        COUNT,
        "park it after this long without requests (0: only when another model needs room)",
        PARKING,
        builtin=0,
        minimum=0,
        maximum=MAX_SECONDS,
        metavar="N",
    ),
    Setting(
        "min_ready_seconds",
        COUNT,
        "how long it stays ready before it may be parked to make room",
        PARKING,
        builtin=10,
        minimum=0,
        maximum=MAX_SECONDS,
        metavar="N",
    ),
    Setting(
        "max_waiting",
        COUNT,
        "requests that may wait for it at once",
        PARKING,
        builtin=256,
        minimum=1,
        maximum=MAX_COUNT,
        metavar="N",
        api_minimum=0,
    ),
    Setting(
        "max_queue_seconds",
        COUNT,
        "how long a request may wait for it",
        PARKING,
        builtin=0,
        minimum=1,
        maximum=MAX_SECONDS,
        metavar="N",
        default_words="default: its wake timeout",
        zero_means="wake_timeout_seconds",
    ),
    Setting(
        "max_turn_seconds",
        COUNT,
        "how long it keeps its GPUs busy while others wait",
        PARKING,
        builtin=30,
        minimum=0,
        maximum=MAX_SECONDS,
        metavar="N",
    ),
    Setting(
        "wake_timeout_seconds",
        COUNT,
        "how long a wake may take",
        PARKING,
        builtin=300,
        minimum=0,
        maximum=MAX_SECONDS,
        flag_name="--wake-timeout",
        metavar="SECONDS",
        flag_minimum=1,
        api_minimum=1,
    ),
    Setting(
        "start_timeout_seconds",
        COUNT,
        "how long a start may take",
        PARKING,
        builtin=900,
        minimum=0,
        maximum=MAX_SECONDS,
        flag_name="--start-timeout",
        metavar="SECONDS",
        flag_minimum=1,
        api_minimum=1,
    ),
    Setting(
        "drain_timeout_seconds",
        COUNT,
        "how long a switch waits for its requests in flight before it gives up on parking it",
        PARKING,
        builtin=120,
        minimum=0,
        maximum=MAX_SECONDS,
        flag_name="--drain-timeout",
        metavar="SECONDS",
    ),
    *(_ceiling(ceiling) for ceiling in guards.CEILINGS),
    *(
        Setting(
            name,
            PRICE,
            f"what {what} costs, in your currency (0: nothing), for budgets' "
            "--spend and capyctl usage",
            PRICES,
            default=0,
            metavar="AMOUNT",
        )
        for name, what in (
            ("price_prompt", "a million prompt tokens"),
            ("price_completion", "a million completion tokens"),
            ("price_gpu_hour", "an hour of one of its GPUs"),
        )
    ),
)


def by_name(settings: tuple[Setting, ...] = SETTINGS) -> dict[str, Setting]:
    return {setting.name: setting for setting in settings}


SETTING = by_name()


def builtin_default(name: str) -> int | str | bool:
    """What ``name`` comes to on a deployment that leaves it empty, where no environment
    variable sets the global defaults (the what-if model starts from these)."""
    setting = SETTING[name]
    if setting.default is not None:
        return setting.default
    value = int(setting.builtin or 0)
    if value == 0 and setting.zero_means:
        return builtin_default(setting.zero_means)
    return value
