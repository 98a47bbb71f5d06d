"""Django settings for CapyCTL, read from ``CAPYCTL_*`` environment variables.

Every value goes through a typed reader in :mod:`capyctl.conf`; a bad one stops start-up
with a message naming the variable. ``capyctl start`` turns its flags into these variables
before Django loads, so flags and environment behave the same.
"""

from __future__ import annotations

import os
import secrets
import socket
from pathlib import Path
from typing import Any

import dj_database_url

from capyctl.conf import (
    ConfigError,
    env_bool,
    env_choice,
    env_float,
    env_int,
    env_list,
    env_networks,
    env_optional_str,
    env_path,
    env_secret,
    env_size,
    env_str,
    env_time_zone,
    env_url,
    parse_sim_gpus,
)
from hostagent.simgpu import SIM_PIDS

BASE_DIR = Path(__file__).resolve().parent.parent
# The pages' templates and assets: templates/ and static/ at the top of a checkout; an
# installed wheel carries them inside the package, as capyctl/_web/ (setup.py).
_PACKAGED_WEB = Path(__file__).resolve().parent / "_web"
WEB_ROOT = _PACKAGED_WEB if _PACKAGED_WEB.is_dir() else BASE_DIR

DATA_DIR = env_path("CAPYCTL_DATA_DIR", Path.cwd() / ".capyctl")


def _secret_key() -> str:
    """Use ``CAPYCTL_SECRET_KEY``, else a key kept in the data dir (made once, mode 0600)."""
    given = env_optional_str("CAPYCTL_SECRET_KEY")
    if given is not None:
        if len(given) < 32:
            raise ConfigError("CAPYCTL_SECRET_KEY must be at least 32 characters long")
        return given
    path = DATA_DIR / "secret_key"
    if not path.exists():
        DATA_DIR.mkdir(mode=0o700, parents=True, exist_ok=True)  # it holds secrets
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            pass  # another process made it first; read theirs below
        else:
            with os.fdopen(fd, "w") as handle:
                handle.write(secrets.token_urlsafe(50))
    key = path.read_text().strip()
    if len(key) < 32:
        raise ConfigError(f"the secret key in {path} is shorter than 32 characters")
    return key


SECRET_KEY = _secret_key()
DEBUG = env_bool("CAPYCTL_DEBUG", False)
# Loopback names only unless configured; `capyctl start` adds the address it listens on
# (see capyctl.cli.start). The dashboard's WebSocket origin check uses the same list.
LOCAL_HOSTS = ["localhost", "127.0.0.1", "[::1]", "::1"]
ALLOWED_HOSTS_SET = bool(os.environ.get("CAPYCTL_ALLOWED_HOSTS", "").strip())
ALLOWED_HOSTS = env_list("CAPYCTL_ALLOWED_HOSTS", LOCAL_HOSTS)
CSRF_TRUSTED_ORIGINS = env_list("CAPYCTL_CSRF_TRUSTED_ORIGINS", [])

# Behind a TLS proxy: cookies only over HTTPS, and the proxy's X-Forwarded-Proto says
# whether a request came over HTTPS (the proxy must set it, overwriting the client's).
BEHIND_TLS = env_bool("CAPYCTL_BEHIND_TLS", False)
SESSION_COOKIE_SECURE = CSRF_COOKIE_SECURE = env_bool("CAPYCTL_SECURE_COOKIES", BEHIND_TLS)
if BEHIND_TLS:
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
SESSION_COOKIE_HTTPONLY = True
SESSION_COOKIE_SAMESITE = "Lax"

# /metrics: a scraper sends this as a bearer token (or a staff user's session is used).
METRICS_TOKEN = env_secret("CAPYCTL_METRICS_TOKEN", min_length=16)
# Failed logins per user name and client address before a lockout, and its length.
LOGIN_MAX_FAILURES = env_int("CAPYCTL_LOGIN_MAX_FAILURES", 5, minimum=1)
LOGIN_LOCKOUT_SECONDS = env_int("CAPYCTL_LOGIN_LOCKOUT_SECONDS", 900, minimum=1)
AUTHENTICATION_BACKENDS = ["capyctl.web.login.ThrottledModelBackend"]

INSTALLED_APPS = [  # not "daphne": it only adds runserver, and costs every command Twisted
    "capyctl.adminapp.AdminConfig",  # django.contrib.admin, admin modules loaded with the URLs
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "django_filters",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "channels",
    "capyctl.hosts",
    "capyctl.engines",
    "capyctl.deployments",
    "capyctl.ledger",
    "capyctl.access",
    "capyctl.events",
    "capyctl.scheduler",
    "capyctl.traces",
    "capyctl.web",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "capyctl.urls"
ASGI_APPLICATION = "capyctl.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [WEB_ROOT / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]


def _database() -> dict[str, Any]:
    url = env_optional_str("CAPYCTL_DATABASE_URL") or f"sqlite:///{DATA_DIR / 'capyctl.sqlite3'}"
    try:
        config: dict[str, Any] = dict(dj_database_url.parse(url))
    except Exception as exc:  # dj-database-url raises several types for a bad URL
        raise ConfigError(f"CAPYCTL_DATABASE_URL is not a database URL: {exc}") from None
    engine = config.get("ENGINE", "")
    if engine == "django.db.backends.sqlite3":
        if config["NAME"] != ":memory:":
            Path(config["NAME"]).parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        config["OPTIONS"] = {
            # Every transaction takes the write lock at BEGIN, so the ledger's admission
            # check and its write cannot interleave with another writer's.
            "transaction_mode": "IMMEDIATE",
            "timeout": 20,
            "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
        }
        # Tests get a file too, so threads and processes share it as they would in use.
        config["TEST"] = {"NAME": str(DATA_DIR / "test-capyctl.sqlite3")}
    elif engine == "django.db.backends.postgresql":
        config.setdefault("OPTIONS", {})
        config["CONN_MAX_AGE"] = 0
    else:
        raise ConfigError(
            f"CAPYCTL_DATABASE_URL uses {url.split(':', 1)[0]!r}; use sqlite:// or postgres://"
        )
    return config


DATABASES = {"default": _database()}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

REDIS_URL = env_optional_str("CAPYCTL_REDIS_URL")
if REDIS_URL is not None and not REDIS_URL.startswith(("redis://", "rediss://", "unix://")):
    raise ConfigError("CAPYCTL_REDIS_URL must start with redis://, rediss:// or unix://")

# Server mode (PostgreSQL, Redis, Celery workers) when asked, or when Redis is configured;
# `capyctl start standalone` always runs standalone.
MODE = env_choice(
    "CAPYCTL_MODE", "server" if REDIS_URL else "standalone", ("standalone", "server", "host")
)
if MODE == "server" and REDIS_URL is None:
    raise ConfigError("server mode needs CAPYCTL_REDIS_URL (redis://HOST:PORT/DB)")
if MODE == "server" and DATABASES["default"]["ENGINE"].endswith("sqlite3"):
    raise ConfigError(
        "server mode needs PostgreSQL: set CAPYCTL_DATABASE_URL=postgres://USER@HOST:PORT/NAME"
    )

if REDIS_URL:
    CHANNEL_LAYERS: dict[str, Any] = {
        "default": {
            "BACKEND": "channels_redis.core.RedisChannelLayer",
            "CONFIG": {"hosts": [REDIS_URL], "prefix": "capyctl"},
        }
    }
else:
    CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}

# Celery: Redis as broker in server mode; in standalone the same tasks run in-process.
CELERY_BROKER_URL = REDIS_URL or "memory://"
CELERY_TASK_ALWAYS_EAGER = MODE != "server"
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_WORKER_PREFETCH_MULTIPLIER = 1

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True

STATIC_URL = "/static/"
STATICFILES_DIRS = [WEB_ROOT / "static"]

LOGIN_URL = "/login/"
LOGIN_REDIRECT_URL = "/"
LOGOUT_REDIRECT_URL = "/login/"

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "capyctl.api.auth.ApiKeyAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["capyctl.api.auth.IsAdmin"],
    "DEFAULT_PAGINATION_CLASS": "capyctl.api.pagination.Pages",
    "PAGE_SIZE": 100,
    "DEFAULT_FILTER_BACKENDS": ["django_filters.rest_framework.DjangoFilterBackend"],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "EXCEPTION_HANDLER": "capyctl.api.views.handle_errors",
    "DEFAULT_RENDERER_CLASSES": [
        "rest_framework.renderers.JSONRenderer",
        "rest_framework.renderers.BrowsableAPIRenderer",
    ],
}

SPECTACULAR_SETTINGS = {
    "TITLE": "CapyCTL",
    "DESCRIPTION": "Engines, deployments, hosts, keys, users, the memory ledger and events.",
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "COMPONENT_SPLIT_REQUEST": True,
    # The schema and its docs page are for staff (a session or an admin-scope key).
    "SERVE_PERMISSIONS": ["capyctl.api.auth.IsAdmin"],
}

LOG_LEVEL = env_choice(
    "CAPYCTL_LOG_LEVEL", "INFO", ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
)
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {
        "plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"},
    },
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": LOG_LEVEL},
    "loggers": {"django": {"level": "WARNING"}},
}

# CapyCTL's own settings. Per-deployment values override these defaults.
CAPYCTL: dict[str, Any] = {
    "SIM_GPUS": parse_sim_gpus(
        "CAPYCTL_SIM_GPUS",
        env_optional_str("CAPYCTL_SIM_GPUS"),
        # What the simulated probe shows of the engines' pids (docs/engines.md).
        env_choice("CAPYCTL_SIM_PIDS", "own", SIM_PIDS),
    ),
    # Where simulated engines record what they hold, for the simulated probe to read.
    "SIM_STATE_DIR": env_path("CAPYCTL_SIM_STATE_DIR", DATA_DIR / "sim-gpus"),
    "DEFAULT_PARK": env_choice(
        "CAPYCTL_DEFAULT_PARK", "auto", ("auto", "ram", "deep", "stop", "never")
    ),
    "IDLE_PARK_SECONDS": env_int("CAPYCTL_IDLE_PARK_SECONDS", 0, minimum=0),
    "MIN_READY_SECONDS": env_int("CAPYCTL_MIN_READY_SECONDS", 10, minimum=0),
    "MAX_WAITING": env_int("CAPYCTL_MAX_WAITING", 256, minimum=1),
    "WAKE_TIMEOUT_SECONDS": env_int("CAPYCTL_WAKE_TIMEOUT", 300, minimum=1),
    # How long a request may wait in its model's queue (for room, turns and the wake);
    # 0 (the default): each model's wake timeout.
    "MAX_QUEUE_SECONDS": env_int("CAPYCTL_MAX_QUEUE_SECONDS", 0, minimum=0),
    # How long a busy model keeps its GPUs once others wait for them (0: it gives them up
    # at once, a switch per change of model).
    "MAX_TURN_SECONDS": env_int("CAPYCTL_MAX_TURN_SECONDS", 30, minimum=0),
    "START_TIMEOUT_SECONDS": env_int("CAPYCTL_START_TIMEOUT", 900, minimum=1),
    # Requests in flight on each ready replica of a model of several replicas, on average,
    # past which one more is brought up.
    "TARGET_CONCURRENCY": env_int("CAPYCTL_TARGET_CONCURRENCY", 8, minimum=1),
    "SCALE_UP_WAIT_SECONDS": env_int("CAPYCTL_SCALE_UP_WAIT_SECONDS", 5, minimum=1),
    # How long after a park the GPU probe may take to show its memory freed; past it the
    # model is stopped instead and its engine marked (docs/engines.md).
    "PARK_CONFIRM_SECONDS": env_float("CAPYCTL_PARK_CONFIRM_SECONDS", 10, minimum=0.1),
    "DRAIN_TIMEOUT_SECONDS": env_int("CAPYCTL_DRAIN_TIMEOUT", 120, minimum=0),
    "GPU_RESERVE_BYTES": env_size("CAPYCTL_GPU_RESERVE", 512 * 1024**2),
    "RAM_RESERVE_BYTES": env_size("CAPYCTL_RAM_RESERVE", 2 * 1024**3),
    "MAX_BODY_BYTES": env_size("CAPYCTL_MAX_BODY_BYTES", 32 * 1024**2),
    # A streaming request that waits for its model gets its answer's head and then an SSE
    # comment line this often, so proxies and clients that cut idle connections do not.
    "STREAM_KEEPALIVE_SECONDS": env_float("CAPYCTL_STREAM_KEEPALIVE_SECONDS", 10.0, minimum=0.5),
    # Each /v1 request's metadata (never its body) is recorded for `capyctl trace export`,
    # in at most TRACE_MAX_ROWS rows: past them the oldest go.
    "TRACE": env_bool("CAPYCTL_TRACE", True),
    # Budgets' periods are calendar days, weeks (from Monday) and months in this zone; a
    # budget's soft line crossed is POSTed to ALERT_WEBHOOK too (docs/budgets.md).
    "TIME_ZONE": env_time_zone("CAPYCTL_TIME_ZONE", "UTC"),
    "ALERT_WEBHOOK": env_url("CAPYCTL_ALERT_WEBHOOK"),
    "TRACE_MAX_ROWS": env_int("CAPYCTL_TRACE_MAX_ROWS", 1_000_000, minimum=1),
    # Where hosts reach the server to enrol (HOST:PORT of its enrolment listener): it goes
    # into join tokens. The listener itself is `capyctl start … --enrol-listen`.
    "ENROL_ADDRESS": env_str("CAPYCTL_ENROL_ADDRESS", f"{socket.getfqdn()}:7443"),
    "JOIN_TOKEN_SECONDS": env_int("CAPYCTL_JOIN_TOKEN_SECONDS", 3600, minimum=60),
    # The HTTP server's bounds, so slow or idle clients cannot hold it: a request's head
    # must arrive within HEADER_TIMEOUT seconds and in at most MAX_HEADER_BYTES; an idle
    # kept-alive connection closes after KEEPALIVE_TIMEOUT; past MAX_CONNECTIONS open
    # connections (or requests), new requests get 503.
    "HTTP_HEADER_TIMEOUT": env_float("CAPYCTL_HTTP_HEADER_TIMEOUT", 10.0, minimum=0.1),
    "HTTP_MAX_HEADER_BYTES": env_size("CAPYCTL_HTTP_MAX_HEADER_BYTES", 64 * 1024),
    "HTTP_KEEPALIVE_TIMEOUT": env_int("CAPYCTL_HTTP_KEEPALIVE_TIMEOUT", 5, minimum=1),
    "HTTP_MAX_CONNECTIONS": env_int("CAPYCTL_HTTP_MAX_CONNECTIONS", 4096, minimum=16),
    # Proxies (addresses or networks) whose X-Forwarded-For is believed: the throttles of
    # guessed keys and failed logins then count the client's own address (docs/security.md).
    "TRUSTED_PROXIES": env_networks("CAPYCTL_TRUSTED_PROXIES"),
    # How long the gateway keeps an API key nobody uses in memory (re-read in the background).
    "KEY_KEEP_WARM_SECONDS": env_float("CAPYCTL_KEY_KEEP_WARM_SECONDS", 60.0, minimum=0.1),
    # A request's body must arrive within BODY_TIMEOUT seconds of its head, plus a second
    # for every BODY_MIN_RATE bytes that arrive; else 408. One client address (IPv6: its
    # /64) holds at most MAX_CONNECTIONS_PER_ADDRESS connections (0: no cap); requests
    # without a well-formed /v1 key may use all but KEYED_RESERVE_PERCENT of
    # MAX_CONNECTIONS. Bodies of everything but /v1 (pages, forms, the admin, /api/) stop
    # at MAX_WEB_BODY_BYTES (413), before any of it is read.
    "HTTP_BODY_TIMEOUT": env_float("CAPYCTL_HTTP_BODY_TIMEOUT", 10.0, minimum=0.1),
    "HTTP_BODY_MIN_RATE": env_size("CAPYCTL_HTTP_BODY_MIN_RATE", 16 * 1024),
    "HTTP_MAX_CONNECTIONS_PER_ADDRESS": env_int(
        "CAPYCTL_HTTP_MAX_CONNECTIONS_PER_ADDRESS", 256, minimum=0
    ),
    "HTTP_KEYED_RESERVE_PERCENT": env_int(
        "CAPYCTL_HTTP_KEYED_RESERVE_PERCENT", 25, minimum=0, maximum=90
    ),
    "HTTP_MAX_WEB_BODY_BYTES": env_size("CAPYCTL_HTTP_MAX_WEB_BODY_BYTES", 1024**2),
}
# Nothing a page, form or REST call may send is larger, so Django keeps it in memory.
DATA_UPLOAD_MAX_MEMORY_SIZE = FILE_UPLOAD_MAX_MEMORY_SIZE = CAPYCTL["HTTP_MAX_WEB_BODY_BYTES"]
